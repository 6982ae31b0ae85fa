"""TP plugin: every ``fully_shard`` error for DTensor units, with its message (world 4).

All cases run in one multi-rank call (each builds its own meshes and a small module, and
calls ``fully_shard`` once); the test then checks each case's exception type and message,
and that the module was left untouched.
"""

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from hyperfsdp_core import DataParallelMeshDims, fully_shard
from hyperfsdp_core.plugin import get_plugin_manager
from hyperfsdp_core.testing import run_on_ranks

TIMEOUT = 180


def colwise(tp_mesh) -> nn.Module:
    torch.manual_seed(0)
    return parallelize_module(nn.Linear(4, 6), tp_mesh, ColwiseParallel())


def with_params(**params) -> nn.Module:
    module = nn.Module()
    for name, value in params.items():
        setattr(module, name, nn.Parameter(value))
    return module


def _case_mesh_none(root):
    return colwise(root["tp"]), {}


def _case_mixed_plain_and_dtensor(root):
    module = colwise(root["tp"])
    module.extra = nn.Parameter(torch.ones(3))
    return module, {"mesh": root["dp"]}


def _case_unnamed_dp_mesh(root):
    return colwise(root["tp"]), {"mesh": init_device_mesh("cpu", (4,))}


def _case_unnamed_tp_mesh(root):
    unnamed = init_device_mesh("cpu", (2, 2))
    tp = DeviceMesh.from_group(unnamed.get_group(1), "cpu")
    return colwise(tp), {"mesh": root["dp"]}


def _case_device_types_differ(root):
    meta_tp = DeviceMesh.from_group(root["tp"].get_group(0), "meta", mesh_dim_names=("tp",))
    weight = distribute_tensor(torch.empty(6, 4, device="meta"), meta_tp, [Shard(0)])
    return with_params(weight=weight), {"mesh": root["dp"]}


def _case_dp_groups_are_the_tp_groups(root):
    # another root's dim with the TP groups' ranks, under another name
    other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "y"))
    return colwise(root["tp"]), {"mesh": other["y"]}


def _case_not_a_grid(root):
    # dp groups [0, 3], [1, 2] meet the tp groups [0, 1], [2, 3] in one rank each, but hold
    # ranks of different TP coordinates: FSDP would shard TP shard 0 and 1 together
    crossed = DeviceMesh("cpu", [[0, 1], [3, 2]], mesh_dim_names=("a", "b"))
    return colwise(root["tp"]), {"mesh": crossed["a"]}


def _case_tp_mesh_of_one_group(root):
    # from_group of one process group: the mesh does not know the other TP groups
    tp = DeviceMesh.from_group(root["tp"].get_group(), "cpu", mesh_dim_names=("tp",))
    return colwise(tp), {"mesh": root["dp"]}


def _case_reuses_tp_dim(root):
    return colwise(root["tp"]), {"mesh": root["tp"]}


def _case_partial(root):
    weight = DTensor.from_local(torch.ones(6, 4), root["tp"], [Partial()])
    return with_params(
        weight=weight, bias=distribute_tensor(torch.ones(6), root["tp"], [Shard(0)])
    ), {"mesh": root["dp"]}


def _case_two_replicate_axes(root):
    mesh3 = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp", "ep", "tp"))
    tp2 = mesh3["ep", "tp"]
    ok = distribute_tensor(torch.ones(4, 4), tp2, [Shard(0), Replicate()])
    both = distribute_tensor(torch.ones(4), tp2, [Replicate(), Replicate()])
    return with_params(weight=ok, norm=both), {"mesh": mesh3["dp"]}


def _case_reshard_after_forward_int(root):
    # 2 of a 4-rank shard group (1 and the shard size mean False and True, as in FSDP2)
    mesh = init_device_mesh("cpu", (4, 1), mesh_dim_names=("dp", "tp"))
    return colwise(mesh["tp"]), {"mesh": mesh["dp"], "reshard_after_forward": 2}


def _case_hsdp_without_hsdp_plugin(root):
    mesh3 = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    module = colwise(mesh3["tp"])
    get_plugin_manager().unregister(name="hsdp")  # this rank call's manager only
    return module, {"mesh": mesh3["dp_replicate", "dp_shard"]}


def _spmd(root, placements=None):
    placements = placements or (Replicate(), Shard(0))
    return with_params(weight=distribute_tensor(torch.ones(6, 4), root, list(placements)))


def _case_dims_unnamed_mesh(root):
    unnamed = init_device_mesh("cpu", (2, 2))
    return with_params(
        weight=distribute_tensor(torch.ones(6, 4), unnamed, [Replicate(), Shard(0)])
    ), {
        "mesh": unnamed,
        "dp_mesh_dims": DataParallelMeshDims(shard="dp"),
    }


def _case_dims_unknown_name(root):
    return _spmd(root), {"mesh": root, "dp_mesh_dims": DataParallelMeshDims(shard="fsdp")}


def _case_dims_several_names(root):
    return _spmd(root), {"mesh": root, "dp_mesh_dims": DataParallelMeshDims(shard=("dp", "tp"))}


def _case_dims_plain_params(root):
    return nn.Linear(4, 6), {"mesh": root, "dp_mesh_dims": DataParallelMeshDims(shard="dp")}


def _case_dims_other_mesh(root):
    other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    return _spmd(other), {"mesh": root, "dp_mesh_dims": DataParallelMeshDims(shard="dp")}


def _case_dims_not_replicated_on_dp(root):
    return _spmd(root, (Shard(0), Replicate())), {
        "mesh": root,
        "dp_mesh_dims": DataParallelMeshDims(shard="dp"),
    }


CASES = {name[len("_case_") :]: fn for name, fn in globals().items() if name.startswith("_case_")}


def rank_errors():
    results = {}
    for name, make in CASES.items():
        root = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        module, kwargs = make(root)
        before = {n: p for n, p in module.named_parameters()}
        try:
            fully_shard(module, **kwargs)
        except Exception as exc:
            untouched = all(p is before[n] for n, p in module.named_parameters())
            results[name] = (type(exc).__name__, str(exc), untouched)
        else:
            results[name] = ("no error", "", True)
        finally:
            if name == "hsdp_without_hsdp_plugin":
                from hyperfsdp_hsdp import plugin as hsdp

                get_plugin_manager().register(hsdp, name="hsdp")
    return results


EXPECTED = {
    # the core's checks, which the plugin relies on
    "mesh_none": (
        "ValueError",
        ["need an explicit data-parallel mesh", "weight", "root_mesh['dp']"],
    ),
    "mixed_plain_and_dtensor": (
        "ValueError",
        ["all plain Tensors or all DTensors", "extra (Parameter)", "weight (DTensor)"],
    ),
    # the plugin's
    "unnamed_dp_mesh": (
        "ValueError",
        ["data-parallel mesh has unnamed dims", "'weight', 'bias'", "mesh_dim_names=('dp', 'tp')"],
    ),
    "unnamed_tp_mesh": (
        "ValueError",
        ["'weight', 'bias' are on a mesh with unnamed dims", "mesh_dim_names"],
    ),
    "device_types_differ": (
        "ValueError",
        ["mesh is on 'cpu'", "'weight' are on a 'meta' mesh", "one device type"],
    ),
    "dp_groups_are_the_tp_groups": (
        "ValueError",
        [
            "mesh ('y',) and the tensor-parallel mesh ('tp',) of parameters 'weight', 'bias'",
            "share ranks",
            "other ranks than tensor parallelism",
        ],
    ),
    "not_a_grid": (
        "ValueError",
        [
            "mesh ('a',) and the tensor-parallel mesh ('tp',) of parameters 'weight', 'bias'",
            "do not form a grid",
            "of group [0, 3], but it is at coordinate 1 of group [1, 2]",
            "one tensor-parallel coordinate",
        ],
    ),
    "tp_mesh_of_one_group": (
        "ValueError",
        [
            "of parameters 'weight', 'bias' cannot be joined",
            "covers ranks [0, 1, 2, 3] (4) but the tensor-parallel mesh covers ranks",
            "DeviceMesh.from_group",
        ],
    ),
    "reuses_tp_dim": (
        "ValueError",
        ["mesh dim(s) ['tp']", "'weight', 'bias'", "not root_mesh['tp']"],
    ),
    "partial": (
        "ValueError",
        ["parameters 'weight' have Partial placements", "(Partial(sum),)", "Replicate()"],
    ),
    "two_replicate_axes": (
        "ValueError",
        [
            "several independent tensor-parallel mesh dims",
            "norm (replicated over 'ep', 'tp')",
            "flatten",
        ],
    ),
    "reshard_after_forward_int": (
        "ValueError",
        ["reshard_after_forward=2", "'weight', 'bias'", "True or False"],
    ),
    "hsdp_without_hsdp_plugin": (
        "ImportError",
        ["replicate dim (HSDP)", "pip install hyperfsdp[hsdp]"],
    ),
    "dims_unnamed_mesh": ("ValueError", ["dp_mesh_dims needs a mesh with named dims"]),
    "dims_unknown_name": ("ValueError", ["names ['fsdp']", "('dp', 'tp') does not have"]),
    "dims_several_names": ("ValueError", ["name one shard dim", "flatten"]),
    "dims_plain_params": (
        "ValueError",
        ["every parameter must be a DTensor", "weight (Parameter)", "bias (Parameter)"],
    ),
    "dims_other_mesh": (
        "ValueError",
        ["'weight' are DTensors on another mesh", "mesh=root_mesh['dp']"],
    ),
    "dims_not_replicated_on_dp": (
        "ValueError",
        ["Replicate() on the data-parallel dims ['dp']", "weight (Shard(dim=0), Replicate())"],
    ),
}


@pytest.fixture(scope="module")
def errors():
    assert set(EXPECTED) == set(CASES)
    return run_on_ranks(4, rank_errors, timeout=TIMEOUT)


@pytest.mark.parametrize("case", sorted(CASES))
def test_validation_error_message(errors, case):
    kind, fragments = EXPECTED[case]
    for rank_results in errors:
        got_kind, message, untouched = rank_results[case]
        assert got_kind == kind, (case, got_kind, message)
        for fragment in fragments:
            assert fragment in message, (case, fragment, message)
        assert untouched, f"{case}: fully_shard modified the module before raising"
