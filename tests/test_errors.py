"""Bad input is rejected at fully_shard time, naming the parameter, before anything changes."""

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, init_device_mesh

from hyperfsdp_core import FSDPModule, fully_shard


def expect_error(build, call, *fragments):
    module = build()
    before = {n: p for n, p in module.named_parameters()}
    try:
        call(module)
    except (ValueError, ImportError, RuntimeError) as exc:
        message = str(exc)
        # nothing was changed: same class, same parameter objects
        assert not isinstance(module, FSDPModule)
        assert {n: p for n, p in module.named_parameters()} == before
        missing = [f for f in fragments if f not in message]
        assert not missing, f"{missing} not in: {message}"
        return type(exc).__name__
    raise AssertionError("fully_shard accepted bad input")


class WithScalar(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.temperature = nn.Parameter(torch.tensor(1.0))


def scalar_param():
    return expect_error(WithScalar, fully_shard, "'temperature'", "scalar", "ignored_params")


def uneven_non_dim0():
    def call(m):
        fully_shard(m, shard_placement_fn=lambda p: Shard(1))

    return expect_error(
        lambda: nn.Sequential(nn.Linear(3, 4)), call, "'0.weight'", "(4, 3)", "dim 1", "2 ranks"
    )


def shard_dim_out_of_range():
    def call(m):
        fully_shard(m, shard_placement_fn=lambda p: Shard(1))

    return expect_error(
        lambda: nn.Sequential(nn.Linear(4, 4)),
        call,
        "'0.bias'",
        "(4,)",
        "no dim 1",
        "None to shard dim 0",
    )


def mixed_plain_and_dtensor():
    mesh = init_device_mesh("cpu", (2,))

    def build():
        m = nn.Sequential(nn.Linear(2, 4), nn.Linear(4, 2))
        w = m[1].weight
        m[1].weight = nn.Parameter(
            DTensor.from_local(w.detach(), mesh, [Replicate()], run_check=False)
        )
        return m

    return expect_error(
        build, lambda m: fully_shard(m, mesh=mesh), "0.weight (Parameter)", "1.weight", "all plain"
    )


def already_sharded():
    m = nn.Linear(2, 2)
    fully_shard(m)
    try:
        fully_shard(m)
    except ValueError as exc:
        assert "already applied" in str(exc)
        return True
    return False


def shared_between_units():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(5, 4)
            self.out = nn.Linear(4, 5, bias=False)
            self.out.weight = self.emb.weight

    m = Tied()
    fully_shard(m.emb)
    return expect_error(lambda: m, fully_shard, "'out.weight'", "'emb.weight'", "fully_shard([")


def two_d_mesh_without_plugin():
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    return expect_error(
        lambda: nn.Linear(2, 2), lambda m: fully_shard(m, mesh=mesh), "pip install hyperfsdp[hsdp]"
    )


def bad_reshard_after_forward():
    return expect_error(
        lambda: nn.Linear(2, 2), lambda m: fully_shard(m, reshard_after_forward=3), "divisor"
    )


def offload_without_plugin():
    from hyperfsdp_core import CPUOffloadPolicy

    return expect_error(
        lambda: nn.Linear(2, 2),
        lambda m: fully_shard(m, offload_policy=CPUOffloadPolicy()),
        "pip install hyperfsdp[offload]",
    )


def dp_mesh_dims_without_plugin():
    from hyperfsdp_core import DataParallelMeshDims

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    return expect_error(
        lambda: nn.Linear(2, 2),
        lambda m: fully_shard(m, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp")),
        "pip install hyperfsdp[tp]",
    )


def dtensor_params_without_plugin():
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))

    def tp_linear():
        m = nn.Linear(2, 2)
        for name, p in list(m.named_parameters()):
            dt = DTensor.from_local(p.detach(), mesh["tp"], [Replicate()], run_check=False)
            setattr(m, name, nn.Parameter(dt))
        return m

    return expect_error(
        tp_linear,
        lambda m: fully_shard(m, mesh=mesh["dp"]),
        "'weight'",
        "pip install hyperfsdp[tp]",
    )


CASES = {
    "scalar": (scalar_param, "ValueError"),
    "uneven_non_dim0": (uneven_non_dim0, "ValueError"),
    "shard_dim_out_of_range": (shard_dim_out_of_range, "ValueError"),
    "mixed": (mixed_plain_and_dtensor, "ValueError"),
    "shared": (shared_between_units, "ValueError"),
    "reshard_int": (bad_reshard_after_forward, "ValueError"),
}


def replicate_params_without_plugin():
    def call(m):
        fully_shard(m, replicate_params={m.bias})

    return expect_error(lambda: nn.Linear(2, 2), call, "'bias'", "pip install hyperfsdp[hsdp]")


PLUGIN_CASES = {  # features that need a plugin distribution
    "offload": (offload_without_plugin, "ImportError"),
    "dp_mesh_dims": (dp_mesh_dims_without_plugin, "ImportError"),
    "dtensor_params": (dtensor_params_without_plugin, "ImportError"),
    "two_d_mesh": (two_d_mesh_without_plugin, "ImportError"),
    "replicate_params": (replicate_params_without_plugin, "ImportError"),
}


def run_plugin_case(name):
    """Run with entry-point plugins switched off: the core alone must name the extra."""
    import os

    from hyperfsdp_core.plugin.manager import DISABLE_AUTOLOAD_ENV, reset_plugin_manager

    os.environ[DISABLE_AUTOLOAD_ENV] = "1"
    reset_plugin_manager()
    return PLUGIN_CASES[name][0]()


@pytest.mark.parametrize("name", sorted(PLUGIN_CASES))
def test_missing_plugin_names_the_extra(run_ranks, name):
    assert run_ranks(2, run_plugin_case, name) == [PLUGIN_CASES[name][1]] * 2


def run_case(name):
    return CASES[name][0]()


@pytest.mark.parametrize("name", sorted(CASES))
def test_rejected_with_fqn(run_ranks, name):
    assert run_ranks(2, run_case, name) == [CASES[name][1]] * 2


def test_fully_shard_twice(run_ranks):
    assert run_ranks(2, already_sharded) == [True, True]


def meta_mesh():
    import torch.distributed as dist

    mesh = init_device_mesh("meta", (dist.get_world_size(),))
    return expect_error(
        lambda: nn.Linear(4, 4),
        lambda m: fully_shard(m, mesh=mesh),
        "fully_shard(Linear)",
        "'meta' device, which cannot run collectives",
        "init_device_mesh('cuda'",
        "init_device_mesh('cpu'",
    )


def test_meta_mesh_rejected_at_fully_shard(run_ranks):
    """A mesh on meta has no collective backend: rejected at once, saying to build the mesh
    on the training device (it used to be accepted and to fail at the first forward)."""
    assert run_ranks(2, meta_mesh) == ["ValueError"] * 2
