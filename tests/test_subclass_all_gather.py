"""FSDP2's tensor-subclass all-gather extension (``fsdp_pre_all_gather`` /
``fsdp_post_all_gather``) with a minimal subclass of our own (no torchao).

``Split16Weight`` all-gathers three payload tensors per parameter (the weight in bf16,
its rounding residual in int8 and a fp32 scale shared by all ranks through an
all-reduce over the mesh it is given) plus Python metadata; its unsharded parameter is a
plain fp32 tensor ``bf16 + int8 * scale`` in a buffer of its own, which later
iterations receive back as ``out=``. Training is compared with torch's FSDP2 on the same
script (even shapes: FSDP2 needs them) and with a single-process model that applies the
same rounding to its weights (uneven dim 0, an empty shard at world 4), and the
all-gathers move the payload bytes.
"""

from __future__ import annotations

import collections
import contextlib
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from hyperfsdp_core.testing import registered, shared_memory
from hyperfsdp_core.testing.counting import ObservedBytes, TorchCollectiveBytes

aten = torch.ops.aten
STEPS = 4
TAG = "split16"

_KEEP = {
    aten.new_zeros.default,
    aten.slice.Tensor,
    aten.view.default,
    aten.as_strided.default,
    aten._to_copy.default,
    aten.clone.default,
    aten.detach.default,
    aten.alias.default,
    aten.split.Tensor,
    aten.empty_like.default,
}


def split16(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    hi = x.to(torch.bfloat16)
    q = torch.round((x - hi.float()) / scale).clamp(-127, 127).to(torch.int8)
    return hi, q


def join16(hi: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return hi.float() + q.float() * scale


def scale_of(amax: torch.Tensor) -> torch.Tensor:
    return (amax / 127).clamp(min=1e-12).reshape(1)


class Split16Weight(torch.Tensor):
    """A weight that all-gathers bf16 + int8 residual + a fp32 scale (and metadata)."""

    #: every fsdp_post_all_gather call: (param rows, out given, out's storage, result's)
    posts: list = []

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            data.shape,
            strides=data.stride(),
            dtype=data.dtype,
            device=data.device,
            requires_grad=data.requires_grad,
        )

    def __init__(self, data: torch.Tensor) -> None:
        self._data = data

    def __repr__(self) -> str:
        return f"Split16Weight({self._data!r})"

    def __tensor_flatten__(self):
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Split16Weight(inner["_data"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(t):
            return t._data if isinstance(t, cls) else t

        out = func(*pytree.tree_map(unwrap, args), **pytree.tree_map(unwrap, kwargs or {}))
        if func is aten.copy_.default:
            return args[0]
        if func in _KEEP:
            return pytree.tree_map_only(torch.Tensor, cls, out)
        return out

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        x = self._data
        amax = x.abs().max() if x.numel() else x.new_zeros(())
        amax = amax.clone()
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=mesh.get_group())
        scale = scale_of(amax)
        hi, q = split16(x, scale)
        return (hi, q, scale), {"tag": TAG, "rows": outer_size[0]}

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        hi, q, scales = outputs
        assert metadata["tag"] == TAG and hi.shape[0] == metadata["rows"], metadata
        assert hi.dtype == torch.bfloat16 and q.dtype == torch.int8
        assert torch.all(scales == scales[0])  # one per rank, all equal
        value = join16(hi, q, scales[0]).to(param_dtype)
        if out is not None:
            if isinstance(out, DTensor):  # tensor parallel: the unsharded TP-local tensor
                out = out._local_tensor
            # write in place through an alias with its own version counter: autograd
            # saved the parameter in forward
            st = out.untyped_storage()
            torch.empty(0, dtype=out.dtype).set_(st, 0, out.shape, out.stride()).copy_(value)
            Split16Weight.posts.append((metadata["rows"], True, st._cdata))
            return None
        Split16Weight.posts.append((metadata["rows"], False, value.untyped_storage()._cdata))
        return value, (value,)


class _Rounded(torch.autograd.Function):
    """The single-process reference: the weight rounded as the all-gather rounds it,
    gradients straight through (as the sharded master weight receives them)."""

    @staticmethod
    def forward(ctx, w):
        scale = scale_of(w.abs().max())
        return join16(*split16(w, scale), scale)

    @staticmethod
    def backward(ctx, g):
        return g


class Block(nn.Module):
    """A subclass weight, a plain fp32 bias and a gain (bf16: three dtypes in one unit)."""

    def __init__(self, d_in: int, d_out: int, gain_dtype: torch.dtype) -> None:
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, d_out).to(gain_dtype))

    def forward(self, x, rounded: bool = False):
        w = _Rounded.apply(self.lin.weight) if rounded else self.lin.weight
        return torch.relu(nn.functional.linear(x, w, self.lin.bias) * self.gain.float())


class Net(nn.Module):
    def __init__(self, rows: tuple[int, int, int], gain_dtype: torch.dtype) -> None:
        super().__init__()
        a, b, c = rows
        self.block0 = Block(6, a, gain_dtype)
        self.block1 = Block(a, b, gain_dtype)
        self.head = nn.Linear(b, c)  # in the root unit

    def forward(self, x, rounded: bool = False):
        x = self.block1(self.block0(x, rounded), rounded)
        w = _Rounded.apply(self.head.weight) if rounded else self.head.weight
        return nn.functional.linear(x, w, self.head.bias)


def build(rows, gain_dtype) -> Net:
    torch.manual_seed(0)
    model = Net(rows, gain_dtype)
    for lin in (model.block0.lin, model.block1.lin, model.head):
        lin.weight = nn.Parameter(Split16Weight(lin.weight.data))
    return model


def batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, 6, generator=g), torch.randn(n, 1, generator=g)


@contextlib.contextmanager
def gather_route(route: str):
    """The gloo route of the all-gathers: ``"native"`` (the default; these units are under
    the core's gloo routes' size threshold), ``"shm"`` (the ``hyperfsdp-shm`` plugin's
    shared memory) or one of the core's gloo routes at every size: ``"p2p"`` (point to
    point), ``"all_reduce"`` (in place)."""
    if route == "native":
        yield
        return
    from hyperfsdp_core.comm import gloo

    saved = gloo.ALL_GATHER_MIN_BYTES, gloo.P2P
    gloo.ALL_GATHER_MIN_BYTES = 0
    gloo.P2P = route != "all_reduce"
    try:
        with shared_memory(route == "shm"):
            yield
    finally:
        gloo.ALL_GATHER_MIN_BYTES, gloo.P2P = saved


def rank_train(
    engine: str,
    rows: tuple[int, int, int],
    gain_dtype=torch.float32,
    world: int = 0,
    layout: str = "fsdp",
    route: str = "shm",
) -> dict:
    """Train; ``world`` (the reference, one process): the world whose global batch to use;
    ``layout``: ``"hsdp"`` (a (2, world/2) mesh) or ``"post_forward"``
    (``reshard_after_forward=2`` on the blocks); ``route``: see :func:`gather_route`."""
    world, rank = world or dist.get_world_size(), dist.get_rank()
    Split16Weight.posts.clear()
    model = build(rows, gain_dtype)
    if engine == "reference":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(STEPS):
            x, y = batch(step, 2 * world)
            loss = nn.functional.mse_loss(model(x, rounded=True), y.expand(-1, rows[2]))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        return {"losses": losses, "params": params}
    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        from hyperfsdp_core import fully_shard
    kwargs, block_kwargs = {}, {}
    if layout == "hsdp":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        kwargs = block_kwargs = {"mesh": mesh}
    elif layout == "post_forward":
        block_kwargs = {"reshard_after_forward": 2}
    fully_shard(model.block0, **block_kwargs)
    fully_shard(model.block1, **block_kwargs)
    fully_shard(model, **kwargs)
    locals_ok = all(
        isinstance(m.weight.to_local(), Split16Weight)
        for m in (model.block0.lin, model.block1.lin, model.head)
    )
    unsharded_ids = collections.defaultdict(set)
    for name, unit, lin in (
        ("block0", model.block0, model.block0.lin),
        ("head", model, model.head),
    ):

        def seen(module, args, _name=name, _lin=lin):  # after the unit's own pre-forward
            assert type(_lin.weight) is nn.Parameter  # the plain unsharded parameter
            unsharded_ids[_name].add(id(_lin.weight))

        unit.register_forward_pre_hook(seen)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    observed, gathered = ObservedBytes(), TorchCollectiveBytes()
    losses = []
    with registered(observed, "observed"), gathered, gather_route(route):
        for step in range(STEPS):
            x, y = batch(step, 2 * world)
            x = x.chunk(world)[rank]
            out = model(x)
            loss = nn.functional.mse_loss(out, y.chunk(world)[rank].expand(-1, rows[2]))
            loss.backward()
            opt.step()
            opt.zero_grad()
            avg = loss.detach().clone()
            dist.all_reduce(avg)
            losses.append(avg.item() / world)
    params = {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}
    return {
        "losses": losses,
        "params": params,
        "locals_ok": locals_ok
        and all(
            isinstance(m.weight.to_local(), Split16Weight)
            for m in (model.block0.lin, model.block1.lin, model.head)
        ),
        "posts": list(Split16Weight.posts),
        "unsharded_ids": {k: len(v) for k, v in unsharded_ids.items()},
        "observed_all_gather": observed.bytes["all_gather"],
        "fsdp2_all_gather": gathered.bytes["all_gather"],
    }


def payload_bytes(rows: tuple[int, int, int], world: int, gain_bytes: int = 4) -> int:
    """The all-gather bytes of one step (blocks: forward and backward; the root keeps
    its parameters from forward to backward): bf16 + int8 per padded element, a fp32 scale per rank, for the three
    subclass weights; fp32 biases and the gains as they are."""
    a, b, c = rows
    total = 0
    for out_rows, in_cols, gathers in ((a, 6, 2), (b, a, 2), (c, b, 1)):
        padded = math.ceil(out_rows / world) * world
        total += gathers * (padded * in_cols * 3 + 4 * world)
    for n, gathers in ((a, 2), (b, 2)):  # bias fp32 + gain per block
        padded = math.ceil(n / world) * world
        total += gathers * padded * (4 + gain_bytes)
    padded = math.ceil(c / world) * world
    total += padded * 4  # head bias
    return total


@pytest.mark.parametrize("route", ["shm", "native", "p2p", "all_reduce"])
@pytest.mark.parametrize("world", [2, 4])
def test_trains_as_fsdp2_and_moves_payload_bytes(run_ranks, monkeypatch, world, route):
    """Even shapes: the same losses and parameters as torch's FSDP2 on the same script;
    the subclass stays the sharded local tensor; buffers are reused across iterations
    (``out=`` given, the same storage); the observer's all-gather bytes are FSDP2's and
    the payload's, well under what fp32 would move."""
    if route == "native":  # the core alone: torch.distributed's own collectives
        monkeypatch.setenv("HYPERFSDP_PLUGINS_DISABLE", "shm")
    else:  # the routes of the hyperfsdp-shm plugin's transport
        pytest.importorskip("hyperfsdp_shm")
    rows = (8, 12, 4)
    ours = run_ranks(world, rank_train, "hyperfsdp", rows, torch.float32, 0, "fsdp", route)
    fsdp2 = run_ranks(world, rank_train, "fsdp2", rows)
    for o, f in zip(ours, fsdp2, strict=True):
        torch.testing.assert_close(o["losses"], f["losses"])
        for name in f["params"]:
            torch.testing.assert_close(o["params"][name], f["params"][name], msg=name)
        assert o["locals_ok"] and f["locals_ok"]
        # first unshard builds, every later one passes out= on the same storage
        by_rows = collections.defaultdict(list)
        for r, given, storage in o["posts"]:
            by_rows[r].append((given, storage))
        for r, calls in by_rows.items():
            assert [g for g, _ in calls] == [False] + [True] * (len(calls) - 1), r
            assert len({s for _, s in calls}) == 1, r
            # blocks: forward and backward; the root keeps its parameters to backward
            assert len(calls) == (STEPS if r == rows[2] else 2 * STEPS), r
        assert o["unsharded_ids"] == {"block0": 1, "head": 1}
        per_step = payload_bytes(rows, world)
        assert o["observed_all_gather"] == STEPS * per_step
        assert o["observed_all_gather"] == f["fsdp2_all_gather"]
        fp32 = sum(g * n * k * 4 for n, k, g in ((8, 6, 2), (12, 8, 2), (4, 12, 1)))
        plain = 2 * (8 + 12) * 8 + 4 * 4  # biases and gains
        scales = 5 * 4 * world  # one fp32 scale per rank and gather
        assert per_step - plain - scales == 0.75 * fp32  # 3 bytes per element, not 4


@pytest.mark.parametrize("world", [2, 4])
def test_uneven_dim0_trains(run_ranks, world):
    """Uneven dim 0 (world 4: 5 rows are 2, 2, 1, 0 -- an empty shard), where FSDP2's
    extension asserts, with a bf16 parameter in the same units (FSDP2 refuses mixed
    dtypes): trains as a single process that rounds its weights the same way, and moves
    the padded payload bytes."""
    rows = (7, 5, 3)
    ours = run_ranks(world, rank_train, "hyperfsdp", rows, torch.bfloat16)
    (ref,) = run_ranks(1, rank_train, "reference", rows, torch.bfloat16, world)
    for o in ours:
        torch.testing.assert_close(o["losses"], ref["losses"])
        for name, value in ref["params"].items():
            torch.testing.assert_close(o["params"][name], value, msg=name)
        assert o["locals_ok"]
        assert o["observed_all_gather"] == STEPS * payload_bytes(rows, world, gain_bytes=2)


class PreOnly(torch.Tensor):
    """Half of the extension: an error at fully_shard."""

    def fsdp_pre_all_gather(self, mesh):
        raise AssertionError("never called")


def rank_bad(kind: str) -> str:
    from torch.distributed.tensor import Shard

    from hyperfsdp_core import fully_shard

    model = nn.Sequential(nn.Linear(4, 4))
    data = model[0].weight.data
    if kind == "pre_only":
        model[0].weight = nn.Parameter(data.as_subclass(PreOnly))
        placement = None
    else:
        model[0].weight = nn.Parameter(Split16Weight(data))
        placement = Shard(1)
    try:
        fully_shard(model, shard_placement_fn=lambda p: placement if p.ndim == 2 else None)
    except ValueError as e:
        return str(e)
    return ""


@pytest.mark.parametrize(
    ("kind", "words"),
    [("pre_only", "fsdp_post_all_gather"), ("dim1", "dim 1")],
)
def test_bad_extension_is_named_at_fully_shard(run_ranks, kind, words):
    for message in run_ranks(2, rank_bad, kind):
        assert "'0.weight'" in message and words in message, message


def test_hsdp_trains_as_fsdp2(run_ranks):
    """A (2, 2) mesh: the payload is gathered over the shard group (the mesh given to
    ``fsdp_pre_all_gather`` is the shard mesh), gradients all-reduced over the replicas."""
    rows = (8, 12, 4)
    ours = run_ranks(4, rank_train, "hyperfsdp", rows, torch.float32, 0, "hsdp")
    fsdp2 = run_ranks(4, rank_train, "fsdp2", rows, torch.float32, 0, "hsdp")
    for o, f in zip(ours, fsdp2, strict=True):
        torch.testing.assert_close(o["losses"], f["losses"])
        for name in f["params"]:
            torch.testing.assert_close(o["params"][name], f["params"][name], msg=name)
        assert o["observed_all_gather"] == f["fsdp2_all_gather"]


def test_reshard_after_forward_int_reshards_extension_params_fully(run_ranks):
    """``reshard_after_forward=2`` at world 4 (FSDP2 raises for such parameters): the
    extension's parameters reshard fully and re-gather in backward, the plain ones keep
    their post-forward shard; training is unchanged."""
    rows = (8, 12, 4)
    ours = run_ranks(4, rank_train, "hyperfsdp", rows, torch.float32, 0, "post_forward")
    plain = run_ranks(4, rank_train, "hyperfsdp", rows, torch.float32, 0, "fsdp")
    for o, p in zip(ours, plain, strict=True):
        assert o["losses"] == p["losses"]
        for name in p["params"]:
            assert torch.equal(o["params"][name], p["params"][name]), name
        assert [given for _, given, _ in o["posts"]].count(False) == 3
        assert len(o["posts"]) == len(p["posts"])  # the blocks' weights re-gathered in full


def rank_tensor_parallel(engine: str) -> list[float]:
    """A (dp 2, tp 2) mesh: colwise and rowwise tensor-parallel subclass weights, sharded
    over dp: the payload of the TP-local tensor is gathered, ``out=`` is the DTensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        from hyperfsdp_core import fully_shard
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    for lin in (model[0], model[2]):
        lin.weight = nn.Parameter(Split16Weight(lin.weight.data))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model[0], mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dp = mesh["dp"].get_local_rank()
    losses = []
    for step in range(STEPS):
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(step)).chunk(2)[dp]
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert isinstance(model[0].weight.to_local(), Split16Weight)
    return losses + [p.detach().full_tensor() for p in model.parameters()]


def test_tensor_parallel_trains_as_fsdp2(run_ranks):
    pytest.importorskip("hyperfsdp_tp")
    ours = run_ranks(4, rank_tensor_parallel, "hyperfsdp")
    fsdp2 = run_ranks(4, rank_tensor_parallel, "fsdp2")
    for o, f in zip(ours, fsdp2, strict=True):
        torch.testing.assert_close(o, f)
