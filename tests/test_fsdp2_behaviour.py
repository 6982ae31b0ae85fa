"""Where hyperfsdp must behave as FSDP2 at ``fully_shard`` time and in its setters: each
case runs the same script on hyperfsdp and on torch's own ``fully_shard`` (gloo, CPU)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.tensor import DTensor

from hyperfsdp_core import fully_shard
from hyperfsdp_core.testing.counting import CollectiveCounter
from hyperfsdp_core.testing.reference import (
    MLPStack,
    full,
    local_slice,
    mlp_batch,
    mse_loss,
    train_parity,
)

IMPLS = {"hyperfsdp": fully_shard, "fsdp2": fsdp2_fully_shard}
DIMS = [6, 9, 7, 5, 3]


def build():
    torch.manual_seed(0)
    return MLPStack(DIMS)


def batch(step):
    return mlp_batch(step, 8, DIMS[0])


# -- reshard_after_forward=1 / =<shard group size> (issue 28 item 5) ------------------------------


def trivial_reshard_ints(impl, which):
    shard_fn = IMPLS[impl]
    world = dist.get_world_size()
    raf = 1 if which == "one" else world

    def shard(model):
        for layer in model.layers:
            shard_fn(layer, reshard_after_forward=raf)
        shard_fn(model, reshard_after_forward=raf)

    losses = train_parity(build, shard, batch, mse_loss, steps=3)["losses"]
    # what each unit registers between forward and backward, and what backward gathers
    model = build()
    shard(model)
    x, _ = batch(0)
    with CollectiveCounter() as counted:
        out = model(local_slice(x))
        kept = [not isinstance(layer.weight, DTensor) for layer in model.layers]
        forward_gathers = counted.count("ag")
        mse_loss(out, out).backward()
    backward_gathers = counted.count("ag") - forward_gathers
    return losses, kept, backward_gathers if impl == "hyperfsdp" else None


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("which", ["one", "shard_size"])
def test_trivial_reshard_after_forward_ints_are_bools(run_ranks, world, which):
    """``reshard_after_forward=1`` is ``False`` and ``=<shard size>`` is ``True``, as in FSDP2."""
    ours = run_ranks(world, trivial_reshard_ints, "hyperfsdp", which)
    theirs = run_ranks(world, trivial_reshard_ints, "fsdp2", which)
    n_layers = len(DIMS) - 1
    for (losses, kept, backward_gathers), (fsdp2_losses, fsdp2_kept, _) in zip(ours, theirs):
        assert losses == pytest.approx(fsdp2_losses, rel=1e-5)
        assert kept == fsdp2_kept
        if which == "one":  # as False: every unit keeps its parameters, backward gathers none
            assert kept == [True] * n_layers and backward_gathers == 0
        else:  # as True: every non-root unit reshards and gathers again in backward
            assert kept == [False] * n_layers and backward_gathers == n_layers


# -- containers without forward (issue 28 item 7) --------------------------------------------------


class ModuleListWithForward(nn.ModuleList):
    def forward(self, x):
        for layer in self:
            x = layer(x)
        return x


def containers(impl):
    shard_fn = IMPLS[impl]
    rejected = {}
    for kind, make in {
        "ModuleList": lambda: nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)]),
        "ModuleDict": lambda: nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)}),
    }.items():
        container = make()
        before = [id(p) for p in container.parameters()]
        try:
            shard_fn(container)
        except ValueError as exc:
            unchanged = before == [id(p) for p in container.parameters()]
            rejected[kind] = (unchanged, "do not implement forward" in str(exc), str(exc))
        else:
            rejected[kind] = None
    # a container with its own forward, and the list form, stay supported (torch 2.11's
    # FSDP2 rejects every ModuleList, forward or not; hyperfsdp follows 2.13's)
    if impl == "hyperfsdp" or torch.__version__ >= (2, 13):
        torch.manual_seed(0)
        with_forward = ModuleListWithForward([nn.Linear(4, 4), nn.Linear(4, 4)])
        shard_fn(with_forward)
        with_forward(torch.randn(2, 4)).sum().backward()

    def shard_as_list(model):
        shard_fn(list(model.layers))  # one group of the list's modules
        shard_fn(model)

    losses = train_parity(build, shard_as_list, batch, mse_loss, steps=2)["losses"]
    return rejected, losses


def test_container_without_forward_is_rejected(run_ranks):
    ours = run_ranks(2, containers, "hyperfsdp")
    theirs = run_ranks(2, containers, "fsdp2")
    for (rejected, losses), (fsdp2_rejected, fsdp2_losses) in zip(ours, theirs):
        assert set(rejected) == set(fsdp2_rejected) == {"ModuleList", "ModuleDict"}
        for kind, result in rejected.items():
            assert fsdp2_rejected[kind] is not None  # FSDP2 raises ValueError too
            assert result is not None, f"{kind} accepted"
            unchanged, names_problem, message = result
            assert unchanged and names_problem, message
            assert "fully_shard(list(" in message  # says what to do instead
        assert losses == pytest.approx(fsdp2_losses, rel=1e-5)


# -- set_all_reduce_hook(stream=) on HSDP (issue 28 item 11) --------------------------------------


def all_reduce_hook_stream(impl):
    shard_fn = IMPLS[impl]
    stream = torch.Stream(device="cpu")
    outcome = {}
    for name, shape in {"hsdp": (2, 2), "fsdp": (4,)}.items():
        names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        model = shard_fn(nn.Linear(4, 4), mesh=mesh)
        try:
            model.set_all_reduce_hook(lambda out: None, stream=stream)
            outcome[name] = "accepted"
        except ValueError as exc:
            outcome[name] = str(exc)
        if impl == "hyperfsdp":  # FSDP2's HSDP backward needs stream events (not on CPU)
            # without a stream the hook is set and sees the reduced gradients
            seen = []
            model.set_all_reduce_hook(lambda out, seen=seen: seen.append(out.numel()))
            model(torch.randn(2, 4)).sum().backward()
            outcome[name + "_hook_calls"] = len(seen)
    return outcome


def test_all_reduce_hook_stream_rejected_on_hsdp(run_ranks):
    pytest.importorskip("hyperfsdp_hsdp")
    ours = run_ranks(4, all_reduce_hook_stream, "hyperfsdp")
    theirs = run_ranks(4, all_reduce_hook_stream, "fsdp2")
    for outcome, fsdp2 in zip(ours, theirs):
        assert fsdp2["fsdp"] == outcome["fsdp"] == "accepted"
        assert fsdp2["hsdp"] != "accepted"
        assert "stream" in outcome["hsdp"] and "HSDP" in outcome["hsdp"], outcome["hsdp"]
        assert "'weight'" not in outcome["hsdp"] and "weight" in outcome["hsdp"]
        assert outcome["hsdp_hook_calls"] >= 1 and outcome["fsdp_hook_calls"] >= 1


# -- set_force_sum_reduction_for_comms (issue 28 item 16) -----------------------------------------


def force_sum(enable):
    torch.manual_seed(0)
    model = MLPStack(DIMS)
    ref = MLPStack(DIMS)
    ref.load_state_dict(model.state_dict())
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    for unit in [*model.layers, model]:
        unit.set_force_sum_reduction_for_comms(enable)
        unit.set_gradient_divide_factor(2.0)  # a sum over ranks, halved: not an average
    x, _ = batch(0)
    with CollectiveCounter() as counted:
        mse_loss(model(local_slice(x)), None).backward()
    mse_loss(ref(x), None).backward()  # mean over the global batch: the average of the ranks'
    world = dist.get_world_size()
    worst = max(
        (full(p.grad) - ref_p.grad * world / 2.0).abs().max().item()
        for p, ref_p in zip(model.parameters(), ref.parameters())
    )
    ops = {op for kind, _, op in counted.calls if kind == "rs"}
    return ops, worst


@pytest.mark.parametrize("enable", [True, False])
def test_force_sum_reduction_has_no_effect_reductions_are_sum(run_ranks, enable):
    """The setting changes nothing: every reduce-scatter is already a SUM, scaled once by
    the divide factor, whatever ``enable`` is (the docstring and the compat doc say so)."""
    for ops, worst in run_ranks(4, force_sum, enable):
        assert ops == {str(dist.ReduceOp.SUM)}
        assert worst < 1e-6


def force_sum_rejects_non_bool():
    model = fully_shard(nn.Linear(4, 4))
    try:
        model.set_force_sum_reduction_for_comms("yes")
    except TypeError as exc:
        return str(exc)
    return None


def test_force_sum_reduction_needs_a_bool(run_ranks):
    for message in run_ranks(2, force_sum_rejects_non_bool):
        assert message is not None and "bool" in message


# -- where FSDP2 raises and hyperfsdp works (docs/fsdp2-compat.md, upstream tests) ---------------


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
        self.head = nn.Linear(8 * 4 * 4, 3)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x)).flatten(1))


def conv_batch(step):
    g = torch.Generator().manual_seed(3000 + step)
    x = torch.randn(8, 3, 6, 6, generator=g)
    return x, x


def channels_last_params():
    def build_conv():
        torch.manual_seed(0)
        return ConvNet()

    def shard(model):
        assert not model.conv.weight.is_contiguous()  # channels_last: FSDP2 raises here
        fully_shard(model.conv)
        fully_shard(model)

    return train_parity(build_conv, shard, conv_batch, mse_loss, steps=3)["losses"]


def test_non_contiguous_parameters_train_like_the_reference(run_ranks):
    """FSDP2 raises NotImplementedError for non-contiguous (channels_last) parameters;
    hyperfsdp shards their logical tensor and trains like the unsharded reference."""
    for losses in run_ranks(2, channels_last_params):
        assert len(losses) == 3


def unnamed_hsdp_mesh():
    mesh = init_device_mesh("cpu", (2, 2))  # no mesh_dim_names: FSDP2 asserts on them

    def shard(model):
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)

    return train_parity(build, shard, batch, mse_loss, steps=3)["losses"]


def test_hsdp_mesh_without_dim_names_trains_like_the_reference(run_ranks):
    """FSDP2 requires mesh_dim_names on a 2-D (HSDP) mesh; hyperfsdp uses dim 0 as the
    replicate dim and dim 1 as the shard dim either way."""
    pytest.importorskip("hyperfsdp_hsdp")
    for losses in run_ranks(4, unnamed_hsdp_mesh):
        assert len(losses) == 3


# -- tools/run_fsdp2_upstream.py: the runner of PyTorch's own FSDP2 tests -------------------------

RUNNER_DIR = Path(__file__).resolve().parent.parent / "tools"

UPSTREAM_LIKE = """
import time

import pytest
from torch.distributed._composable.fsdp.fully_shard import FSDPModule as OldPathFSDPModule
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


def test_names_are_swapped():
    import hyperfsdp_core

    assert fully_shard is hyperfsdp_core.fully_shard
    assert FSDPModule is OldPathFSDPModule is hyperfsdp_core.FSDPModule
    assert MixedPrecisionPolicy is hyperfsdp_core.MixedPrecisionPolicy


def test_fails():
    raise ValueError("boom")


def test_skips():
    pytest.skip("needs a GPU")


def test_hangs():
    time.sleep(60)
"""


def run_runner(test_dir, impl):
    code = (
        f"import pathlib, sys; sys.path.insert(0, {str(RUNNER_DIR)!r}); "
        "import run_fsdp2_upstream as r; "
        f"code, report = r.run_upstream(pathlib.Path({str(test_dir)!r}), {impl!r}, 2.0); "
        "print('ROWS', repr(report.rows))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("ROWS ")]
    assert line, done.stdout + done.stderr
    rows = ast.literal_eval(line[-1][5:])
    return {nodeid.split("::")[-1]: row for nodeid, row in rows.items()}, done.stdout


def test_upstream_runner_swaps_names_and_reports_each_test(tmp_path):
    (tmp_path / "test_upstream_like.py").write_text(UPSTREAM_LIKE)
    rows, table = run_runner(tmp_path, "hyperfsdp")
    assert rows["test_names_are_swapped"] == ("passed", "")
    assert rows["test_fails"] == ("failed", "ValueError: boom")
    assert rows["test_skips"][0] == "skipped" and "needs a GPU" in rows["test_skips"][1]
    assert rows["test_hangs"][0] == "failed" and "TIMEOUT" in rows["test_hangs"][1]
    assert "1 passed" in table and "2 failed" in table and "1 skipped" in table
    # the baseline leaves torch's FSDP2 in place
    rows, _ = run_runner(tmp_path, "fsdp2")
    assert rows["test_names_are_swapped"][0] == "failed"


# -- what FSDP2's private lazy-init tests guard, through the public API ---------------------------


def lazy_init_order(impl):
    shard_fn = IMPLS[impl]
    outcome = {}
    torch.manual_seed(0)
    model = MLPStack(DIMS)
    shard_fn(model.layers[0])
    shard_fn(model)
    model.layers[0](torch.randn(2, DIMS[0])).sum().backward()  # a sub-unit runs first
    try:
        model(torch.randn(2, DIMS[0]))
        outcome["sub_unit_first"] = "accepted"
    except RuntimeError as exc:
        outcome["sub_unit_first"] = str(exc)
    pair = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    shard_fn([pair[0], pair[1]])  # a list unit with no parent unit: no single root
    try:
        pair(torch.randn(2, 4))
        outcome["list_root"] = "accepted"
    except RuntimeError as exc:
        outcome["list_root"] = str(exc)
    return outcome


def test_lazy_init_order_errors_match_fsdp2(run_ranks):
    """FSDP2's tests check these through its private state (``_lazy_init``): a forward
    through a sub-unit before the root, and a list unit as the root, raise RuntimeError."""
    ours = run_ranks(2, lazy_init_order, "hyperfsdp")
    theirs = run_ranks(2, lazy_init_order, "fsdp2")
    for outcome, fsdp2 in zip(ours, theirs):
        for case in ("sub_unit_first", "list_root"):
            assert fsdp2[case] != "accepted"
            assert outcome[case] != "accepted" and "root" in outcome[case], outcome[case]
