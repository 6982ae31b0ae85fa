"""TP plugin: the root-tail TP all-reduce, counted and ordered, and gradients as plain tensors.

Collectives are logged with a ``hyperfsdp_collective_observer`` plugin (every collective the
root issues, in issue order: kind, group size, bytes). The TP all-reduce is the plugin's
phase ``tp.replicate_all_reduce``, which the core runs after ``dp.all_reduce`` has waited for
every data-parallel all-reduce, so it is issued after every data-parallel collective.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from hyperfsdp_tp import plugin as tp_plugin
from hyperfsdp_tp.testing import Transformer, full, parallelize
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from hyperfsdp_core import fully_shard
from hyperfsdp_core.plugin import hookimpl, unit_of
from hyperfsdp_core.testing import registered
from hyperfsdp_core.testing.reference import token_batch

TIMEOUT = 180
VOCAB = 32


class Observer:
    """Logs every collective; records the gradients reducers are handed."""

    def __init__(self) -> None:
        self.events: list = []
        self.reduced_types: set[str] = set()

    @hookimpl
    def hyperfsdp_collective_observer(self, root):
        return self.events.append

    @hookimpl
    def hyperfsdp_gradient_reducers(self, unit):
        def record(reductions):
            for red in reductions:
                self.reduced_types.add(type(red.output).__name__)
                for p in red.params:
                    grad = red.grad_of(p)
                    if grad is not None:
                        self.reduced_types.add(type(grad).__name__)

        return record


def build(shape, variant="sp"):
    names = ("dp", "tp") if len(shape) == 2 else ("dp_replicate", "dp_shard", "tp")
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    dp = mesh["dp"] if len(shape) == 2 else mesh["dp_replicate", "dp_shard"]
    torch.manual_seed(0)
    model = Transformer(vocab=VOCAB)
    ref = copy.deepcopy(model)
    parallelize(model, mesh["tp"], variant)
    return mesh, dp, model, ref


def shard(model, dp, fn=fully_shard):
    for block in model.layers:
        fn(block, mesh=dp)
    fn(model, mesh=dp)
    return model


def step_events(observer, model, x, y):
    observer.events.clear()
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    return [(e.kind, e.group_size, e.nbytes) for e in observer.events]


def tp_replicated_bytes(model):
    rows = model.sharding_plan()
    return sum(
        4 * torch.Size(row.local_shape).numel() for row in rows if row.tp_replicate_axis is not None
    )


def rank_count_and_order(shape):
    mesh, dp, model, _ = build(shape)
    observer = Observer()
    dp_rank = mesh.get_local_rank(0)
    with registered(observer, "test_tp_observer"):
        shard(model, dp)
        logs = []
        for step in range(2):
            x, y = token_batch(step, 4, 8, VOCAB)
            logs.append(step_events(observer, model, x.chunk(2)[dp_rank], y.chunk(2)[dp_rank]))
    return logs, tp_replicated_bytes(model), sorted(observer.reduced_types)


@pytest.mark.parametrize("shape", [(2, 2), (2, 1, 2)])
def test_tp_all_reduce_once_per_step_after_every_data_parallel_collective(run_ranks, shape):
    """FSDP+TP: all-gathers and reduce-scatters (dp groups of 2), then one all-reduce over the
    TP group (2 ranks) carrying exactly the TP-replicated norm weights' local shards.
    HSDP+TP (replicate 2, shard 1, tp 2): no all-gather, no reduce-scatter, one replicate
    all-reduce per unit (3 units), then the TP all-reduce last. Reducers see plain tensors."""
    for logs, tp_bytes, reduced in run_ranks(4, rank_count_and_order, shape, timeout=TIMEOUT):
        assert reduced == ["Tensor"]
        for events in logs:
            kinds = [k for k, _, _ in events]
            *dp_part, last = events
            assert last == ("all_reduce", 2, tp_bytes)  # norm weights only, last
            if len(shape) == 2:
                assert tp_bytes == 4 * (2 * 2 * 8 + 8)  # 5 norms of 16, dp shard of 8 rows
                assert "all_reduce" not in [k for k, _, _ in dp_part]
                assert kinds.count("reduce_scatter") == 3
                assert kinds.index("all_reduce") > max(
                    i for i, k in enumerate(kinds) if k == "reduce_scatter"
                )
            else:
                assert tp_bytes == 4 * 5 * 16  # shard size 1: whole norm weights
                assert kinds == ["all_reduce"] * 4
                assert all(nbytes > tp_bytes for _, _, nbytes in dp_part)  # whole units


class TPMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(8, 16, bias=False)
        self.w2 = nn.Linear(16, 8, bias=False)

    def forward(self, x):
        return self.w2(torch.relu(self.w1(x)))


def rank_no_tp_replicated_params():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    tp_model = parallelize_module(
        TPMLP(), mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()}
    )
    plain = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    observer = Observer()
    counts = {}
    with registered(observer, "test_tp_observer"):
        fully_shard(tp_model, mesh=mesh["dp"])
        fully_shard(plain[0])
        fully_shard(plain)
        for name, model in (("tp_mlp", tp_model), ("plain", plain)):
            x = torch.randn(4, 8)
            for _ in range(2):
                observer.events.clear()
                model(x).sum().backward()
            counts[name] = [e.kind for e in observer.events].count("all_reduce")
            # nothing for the phase to do: the plugin gives these units no reducer at all
            counts[name + "_reducers"] = [
                tp_plugin.hyperfsdp_gradient_reducers(unit_of(m))
                for m in model.modules()
                if unit_of(m) is not None
            ]
    return counts


def test_no_tp_all_reduce_without_tp_replicated_params(run_ranks):
    """A TP model whose parameters are all TP-sharded, and a plain FSDP model, with the plugin
    installed: zero all-reduces, no reducer, nothing held (the phase finds nothing to do)."""
    for counts in run_ranks(4, rank_no_tp_replicated_params, timeout=TIMEOUT):
        assert counts == {
            "tp_mlp": 0,
            "tp_mlp_reducers": [None],
            "plain": 0,
            "plain_reducers": [None, None],
        }


# -- accumulation: gradient sync off, HSDP all-reduce off ------------------------------------------


def rank_accumulation(shape, mode):
    mesh, dp, model, ref = build(shape, "sp")
    observer = Observer()
    n_dp = 2
    dp_rank = mesh.get_local_rank(0)
    micro = 3
    per_step = []
    with registered(observer, "test_tp_observer"):
        shard(model, dp)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
        for step in range(2):
            tp_all_reduces = []
            for i in range(micro):
                last = i == micro - 1
                if mode == "no_sync":
                    model.set_requires_gradient_sync(last)
                elif mode == "no_all_reduce":  # HSDP: all-reduce only the last micro-batch
                    model.set_requires_all_reduce(last)
                else:  # all-reduce off throughout; reduce_grads() after the last micro-batch
                    model.set_requires_all_reduce(False)
                x, y = token_batch(10 * step + i, 2 * n_dp, 8, VOCAB)
                events = step_events(
                    observer, model, x.chunk(n_dp)[dp_rank], y.chunk(n_dp)[dp_rank]
                )
                tp_all_reduces.append(sum(1 for e in events if e[2] == tp_replicated_bytes(model)))
                F.cross_entropy(ref(x).flatten(0, 1), y.flatten()).backward()
            if mode == "reduce_grads":  # a pipeline schedule's explicit reduce
                observer.events.clear()
                model.reduce_grads()
                size = tp_replicated_bytes(model)
                tp_all_reduces[-1] += sum(1 for e in observer.events if e.nbytes == size)
            per_step.append(tp_all_reduces)
            grads = {n: full(p.grad) for n, p in model.named_parameters()}
            for n, p in ref.named_parameters():
                torch.testing.assert_close(grads[n], p.grad, atol=1e-5, rtol=1e-4, msg=n)
            opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(full(dict(model.named_parameters())[n].detach()), p.detach())
    return per_step


@pytest.mark.parametrize(
    ("shape", "mode"),
    [
        ((2, 2), "no_sync"),
        ((2, 1, 2), "no_sync"),
        ((2, 1, 2), "no_all_reduce"),
        ((2, 1, 2), "reduce_grads"),
    ],
)
def test_accumulation_reduces_over_tp_once(run_ranks, shape, mode):
    """Three micro-batches per step: with gradient sync off, and with HSDP's all-reduce off
    (the hsdp plugin holds those reductions as partial sums; the TP phase waits until the
    hsdp plugin is done with them, and sums over TP once: inside the last micro-batch's
    reduction, or when reduce_grads() flushes the partial sums). Gradients equal the
    reference's accumulated gradients; one TP all-reduce per step."""
    for per_step in run_ranks(4, rank_accumulation, shape, mode, timeout=TIMEOUT):
        assert per_step == [[0, 0, 1], [0, 0, 1]]


# -- no redistribute: the engine reduces local tensors ---------------------------------------------


def rank_no_redistribute():
    mesh, dp, model, ref = build((2, 2), "sp")
    fsdp2 = parallelize(copy.deepcopy(ref), mesh["tp"], "sp")
    shard(model, dp)
    shard(fsdp2, dp, torch_fully_shard)
    orig = DTensor.redistribute
    calls = {"hyperfsdp": 0, "fsdp2": 0}
    current = []

    def counting(self, *args, **kwargs):
        if current:
            calls[current[0]] += 1
        return orig(self, *args, **kwargs)

    x, y = token_batch(0, 4, 8, VOCAB)
    dp_rank = mesh.get_local_rank("dp")
    x, y = x.chunk(2)[dp_rank], y.chunk(2)[dp_rank]
    DTensor.redistribute = counting
    try:
        for name, m in (("hyperfsdp", model), ("fsdp2", fsdp2)):
            loss = F.cross_entropy(m(x).flatten(0, 1), y.flatten())
            current.append(
                name
            )  # count during backward only (the TP plan redistributes inputs in forward)
            loss.backward()
            current.clear()
    finally:
        DTensor.redistribute = orig
    return calls


def test_gradients_reach_the_engine_without_redistribute(run_ranks):
    """Under sequence parallelism the norm weights' gradients are Partial: torch FSDP2
    redistributes them in its post-backward; hyperfsdp calls DTensor.redistribute zero times
    in backward (the TP sum is its root-tail all-reduce on plain tensors)."""
    for calls in run_ranks(4, rank_no_redistribute, timeout=TIMEOUT):
        assert calls["hyperfsdp"] == 0
        assert calls["fsdp2"] > 0
