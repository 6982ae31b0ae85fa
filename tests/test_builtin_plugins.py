"""The built-in plugins stand on the public plugin API, and what they needed from it works for
any plugin: ``RootView.drain_reductions()`` (the core's drain phase) and ``placements_for``
(the core's default parameter layout); so does ``group_timeout``, which the shm and dcp plugins
need. ``tests/test_public_api.py`` checks their imports."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from hyperfsdp_core import fully_shard
from hyperfsdp_core.plugin import (
    FIRST_PHASE,
    Phase,
    build_plugin_manager,
    ddp_mesh_info,
    group_timeout,
    hookimpl,
    placements_for,
    unit_of,
)
from hyperfsdp_core.testing import DEFAULT_TIMEOUT, registered
from hyperfsdp_core.testing.reference import MLPStack, mlp_batch, mse_loss, train_parity

TIMEOUT = 120
DIMS = [8, 12, 10, 6]


class _Root:
    """Stands in for a RootView: records what the core's phase asks of it."""

    def __init__(self) -> None:
        self.drains = 0

    def drain_reductions(self) -> None:
        self.drains += 1


def test_the_core_drain_phase_is_the_public_drain_reductions():
    pm = build_plugin_manager(autoload=False)
    first = pm.finalization_phases()[0]
    assert (first.name, pm.phase_owners()[first.name]) == (FIRST_PHASE, "hyperfsdp.core")
    root = _Root()
    first.run(root)  # nothing but the public method: no engine object behind the view
    assert root.drains == 1


# -- RootView.drain_reductions() from a plugin ------------------------------------------------------

#: per rank process: one entry per backward, (layer index -> has a gradient) when the middle
#: layer's output gradient arrived, and the same at the end of the backward
_seen: list[dict[str, list[bool]]] = []


def _has_grads(model) -> list[bool]:
    return [layer.weight.grad is not None for layer in model.layers]


class DrainAgainPhase:
    """A phase after the core's drain that drains again: nothing is pending, nothing changes."""

    @hookimpl
    def hyperfsdp_finalize_phases(self):
        return [Phase("test.drain_again", self.run, after=FIRST_PHASE)]

    def run(self, root) -> None:
        before = [p.sharded_param.grad.to_local().clone() for u in root.units for p in u.params]
        root.drain_reductions()
        after = [p.sharded_param.grad.to_local() for u in root.units for p in u.params]
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        _seen[-1]["end"] = _has_grads(root.unit.modules[0])


def _shard_with_early_drain(model) -> None:
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)

    def drain_now(grad):
        # the last layer's post-backward has issued its reduce-scatter; land it now
        unit_of(model).root.drain_reductions()
        _seen.append({"mid": _has_grads(model)})

    def on_middle_output(module, args, out) -> None:
        out.register_hook(drain_now)

    model.layers[1].register_forward_hook(on_middle_output)


def rank_early_drain():
    _seen.clear()
    with registered(DrainAgainPhase(), "test_drain_again"):
        result = train_parity(
            lambda: MLPStack(DIMS),
            _shard_with_early_drain,
            lambda step: mlp_batch(step, 8, DIMS[0]),
            mse_loss,
            steps=3,
        )
    return result["losses"], result["ref_losses"], list(_seen)


@pytest.mark.parametrize("world", [2, 4])
def test_a_plugin_drains_the_reductions_during_the_backward(run_ranks, world):
    for losses, ref_losses, seen in run_ranks(world, rank_early_drain, timeout=TIMEOUT):
        assert len(losses) == 3 and losses == pytest.approx(ref_losses, rel=1e-4)
        # mid-backward: the last layer's gradient has landed, the earlier layers' not yet;
        # at the end (after the core's drain and a second, empty one) every layer has one
        assert seen == [{"mid": [False, False, True], "end": [True, True, True]}] * 3


# -- placements_for -----------------------------------------------------------------------------------


def rank_default_placements():
    torch.manual_seed(0)
    results = {}
    meshes = {
        "fsdp": init_device_mesh("cpu", (4,)),
        "hsdp": init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")),
    }
    for name, mesh in meshes.items():
        model = MLPStack([8, 12, 6])
        fully_shard(model, mesh=mesh, shard_placement_fn=lambda p: Shard(p.ndim - 1))
        results[name] = [
            (p.fqn, tuple(p.placements), placements_for(p.mesh_info, p.shard_dim))
            for p in unit_of(model).params
        ]
    flat = meshes["fsdp"]
    ddp = ddp_mesh_info(flat, flat.get_group(0), 4, flat.get_local_rank(0))
    results["ddp"] = placements_for(ddp, 0)
    return results


def test_placements_for_is_the_core_default_layout(run_ranks):
    for results in run_ranks(4, rank_default_placements, timeout=TIMEOUT):
        for kind, expected in (("fsdp", ()), ("hsdp", (Replicate(),))):
            rows = results[kind]
            assert [fqn for fqn, _, _ in rows] == [
                "layers.0.weight",
                "layers.0.bias",
                "layers.1.weight",
                "layers.1.bias",
            ]
            for fqn, actual, default in rows:
                shard_dim = 1 if fqn.endswith("weight") else 0  # shard_placement_fn's last dim
                assert actual == default == (*expected, Shard(shard_dim)), (kind, fqn)
        assert results["ddp"] == (Replicate(),)


# -- group_timeout ------------------------------------------------------------------------------------


def rank_group_timeouts() -> list[float]:
    world = dist.group.WORLD
    group = dist.new_group(timeout=timedelta(seconds=77))
    unreadable = object()  # not a process group: torch's default
    return [group_timeout(g).total_seconds() for g in (None, world, group, unreadable)]


def test_group_timeout_is_the_timeout_a_group_was_created_with(run_ranks):
    # the harness creates the default group with DEFAULT_TIMEOUT
    default = dist.default_pg_timeout.total_seconds()
    expected = [DEFAULT_TIMEOUT, DEFAULT_TIMEOUT, 77.0, default]
    assert run_ranks(2, rank_group_timeouts, timeout=TIMEOUT) == [expected] * 2
