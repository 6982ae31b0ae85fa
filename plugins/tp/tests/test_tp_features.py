"""TP plugin composed with the rest of hyperfsdp (world 4, dp=2 x tp=2 unless said):
mixed precision, activation checkpointing, ``reshard_after_forward``, ``replicate_params``,
meta-device init with a full state dict, ``state_dict()`` / DCP round trips, and
``sharding_plan()``'s tensor-parallel columns.
"""

import copy
import functools

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from hyperfsdp_tp.testing import Transformer, full, parallelize, train_parity
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.utils.checkpoint import checkpoint

from hyperfsdp_core import MixedPrecisionPolicy, fully_shard
from hyperfsdp_core.plugin import hookimpl
from hyperfsdp_core.testing import registered
from hyperfsdp_core.testing.reference import token_batch

TIMEOUT = 180
VOCAB = 32


def setup(variant="sp", vocab=VOCAB, **kwargs):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = Transformer(vocab=vocab, **kwargs)
    ref = copy.deepcopy(model)
    parallelize(model, mesh["tp"], variant)
    return mesh, model, ref


def shard(model, mesh, **kwargs):
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"], **kwargs)
    fully_shard(model, mesh=mesh["dp"], **kwargs)
    return model


def norms(module):
    return {p for name, p in module.named_parameters() if "norm" in name}


# -- activation checkpointing, reshard_after_forward, replicate_params -----------------------------


def rank_composition(kind):
    mesh, model, ref = setup("sp")
    if kind == "activation_checkpointing":
        for block in model.layers:  # non-reentrant recomputation inside backward
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
        shard(model, mesh)
    elif kind == "no_reshard_after_forward":
        shard(model, mesh, reshard_after_forward=False)
    else:  # replicate_params: norms are not sharded, all-reduced over dp, then over tp
        for block in model.layers:
            fully_shard(block, mesh=mesh["dp"], replicate_params=norms(block))
        fully_shard(model, mesh=mesh["dp"], replicate_params={model.norm.weight})
    out = train_parity([model], ref, mesh.get_local_rank("dp"), 2)
    plan = {row.fqn: (row.mesh_kind, row.local_shape) for row in model.sharding_plan()}
    return len(out["norms"]), plan["layers.0.attn_norm.weight"]


@pytest.mark.parametrize(
    "kind", ["activation_checkpointing", "no_reshard_after_forward", "replicate_params"]
)
def test_composes_with(run_ranks, kind):
    for steps, norm_row in run_ranks(4, rank_composition, kind, timeout=TIMEOUT):
        assert steps == 3
        if kind == "replicate_params":
            assert norm_row == ("DDP", (16,))  # whole norm weight, no dp sharding
        else:
            assert norm_row == ("FSDP", (8,))


# -- mixed precision ------------------------------------------------------------------------------


class DTypeLog:
    def __init__(self) -> None:
        self.all_reduces: list = []

    @hookimpl
    def hyperfsdp_collective_observer(self, root):
        def log(event):
            if event.kind == "all_reduce":
                self.all_reduces.append(str(event.dtype))

        return log


def rank_mixed_precision():
    mesh, model, ref = setup("sp")
    fsdp2 = parallelize(copy.deepcopy(ref), mesh["tp"], "sp")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    log = DTypeLog()
    with registered(log, "test_tp_dtypes"):
        shard(model, mesh, mp_policy=policy)
        torch_policy = TorchMixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
        for block in fsdp2.layers:
            torch_fully_shard(block, mesh=mesh["dp"], mp_policy=torch_policy)
        torch_fully_shard(fsdp2, mesh=mesh["dp"], mp_policy=torch_policy)
        seen = {}

        def note(module, args):
            seen.setdefault("wq", (type(module.weight).__name__, module.weight.dtype))

        handle = model.layers[0].attn.wq.register_forward_pre_hook(note)
        out = train_parity([model, fsdp2], ref, mesh.get_local_rank("dp"), 2, atol=3e-2, rtol=3e-2)
        handle.remove()
    rows = {r.fqn: (r.param_dtype, r.reduce_dtype) for r in model.sharding_plan()}
    return out["losses"], seen["wq"], log.all_reduces, rows["layers.0.attn_norm.weight"]


def test_mixed_precision_bf16_compute_fp32_reduce(run_ranks):
    """bf16 all-gather and compute, fp32 reduce-scatter and TP all-reduce: the module computes
    with bf16 TP DTensors; norms, clipping and parameters track the fp32 reference within
    bf16 tolerance, and losses track torch FSDP2's with the same policy. (``train_parity``
    checks every step that ``.grad`` are fp32 DTensors with the parameters' placements.)"""
    for losses, wq, all_reduces, dtypes in run_ranks(4, rank_mixed_precision, timeout=TIMEOUT):
        ours, fsdp2 = losses
        assert ours == pytest.approx(fsdp2, rel=1e-2)
        assert wq == ("DTensor", torch.bfloat16)
        assert all_reduces == ["torch.float32"] * 3  # the TP all-reduce, once per step
        assert dtypes == (torch.bfloat16, torch.float32)


# -- meta init, state dicts, DCP ---------------------------------------------------------------


def rank_meta_init_and_checkpoints(path):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    ref = Transformer(vocab=37, hidden=26)  # uneven TP-local dim 0: strided uneven shards
    with torch.device("meta"):
        model = Transformer(vocab=37, hidden=26)
    parallelize(model, mesh["tp"], "sp")
    shard(model, mesh)
    model.to_empty(device="cpu")
    model.load_state_dict(ref.state_dict())  # plain full tensors: each rank takes its shard
    for n, p in ref.named_parameters():
        torch.testing.assert_close(full(dict(model.named_parameters())[n].detach()), p.detach())
    train_parity([model], ref, mesh.get_local_rank("dp"), 2, steps=2, vocab=37)

    state = model.state_dict()
    kinds = {(type(v).__name__, len(v.placements)) for v in state.values()}
    dcp.save(state, checkpoint_id=path)
    # a second, differently initialized model loads the checkpoint
    torch.manual_seed(1)
    other = Transformer(vocab=37, hidden=26)
    parallelize(other, mesh["tp"], "sp")
    shard(other, mesh)
    other_state = other.state_dict()
    dcp.load(other_state, checkpoint_id=path)
    other.load_state_dict(other_state)
    same = all(
        torch.equal(full(p.detach()), full(dict(model.named_parameters())[n].detach()))
        for n, p in other.named_parameters()
    )
    # and the in-memory round trip with DTensors of the same layout
    other.load_state_dict(model.state_dict())
    train_parity([other], ref, mesh.get_local_rank("dp"), 2, steps=1, vocab=37)
    return kinds, same


def test_meta_init_full_state_dict_and_dcp_round_trip(run_ranks, tmp_path):
    """Meta-device model, parallelized and sharded, ``to_empty`` + ``load_state_dict`` of the
    reference's plain full tensors; trains in parity; its ``state_dict()`` holds DTensors with
    the full (dp, tp) placements, and a DCP save/load into another model restores every
    parameter exactly, uneven strided shards included."""
    for kinds, same in run_ranks(4, rank_meta_init_and_checkpoints, str(tmp_path), timeout=TIMEOUT):
        assert kinds == {("DTensor", 2)}
        assert same


# -- sharding_plan ------------------------------------------------------------------------------


def rank_plan():
    mesh, model, _ = setup("sp")
    shard(model, mesh)
    plan = model.sharding_plan()
    rows = {
        r.fqn: (r.mesh_kind, r.local_shape, r.column("tp_placement"), r.tp_replicate_axis)
        for r in plan
    }
    return rows, str(plan)


def test_sharding_plan_shows_tp_placement_and_replicate_axis(run_ranks):
    for rows, table in run_ranks(4, rank_plan, timeout=TIMEOUT):
        assert rows["layers.0.attn.wq.weight"] == ("FSDP", (4, 16), "tp:S(0)", None)
        assert rows["layers.0.attn.wo.weight"] == ("FSDP", (8, 8), "tp:S(1)", None)
        assert rows["layers.0.attn_norm.weight"] == ("FSDP", (8,), "tp:R", "tp")
        assert rows["norm.weight"] == ("FSDP", (8,), "tp:R", "tp")
        header = table.splitlines()[0].split()
        assert header[-2:] == ["tp_placement", "tp_replicate_axis"]


# -- what torch hands back for replicated parameters ----------------------------------------------


def rank_norm_grad_placements():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x, y = token_batch(0, 2, 8, VOCAB)
    seen = {}
    for variant in ("sp", "no_sp", "no_sp_dtensor"):
        torch.manual_seed(0)
        model = parallelize(Transformer(vocab=VOCAB), mesh["tp"], variant)  # TP only, no FSDP
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        seen[variant] = tuple(model.layers[0].attn_norm.weight.grad.placements)
    return seen


def test_torch_norm_gradient_placements_the_plugin_handles(run_ranks):
    """The premise of the TP reduction: a replicated norm weight's gradient is Partial(sum)
    under sequence parallelism (and when norms return DTensors), but Replicate() (already
    complete on every TP rank) when norms return local tensors. The parity tests of every
    variant show both are reduced right (one SUM over TP of partial sums; Replicate kept on
    TP rank 0 only)."""
    for seen in run_ranks(4, rank_norm_grad_placements, timeout=TIMEOUT):
        assert {k: repr(v) for k, v in seen.items()} == {
            "sp": "(Partial(sum),)",
            "no_sp": "(Replicate(),)",
            "no_sp_dtensor": "(Partial(sum),)",
        }
