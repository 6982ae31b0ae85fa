"""Class unioning (FSDP<Name>), pickling/repr of the unioned classes, sharding_plan()."""

import copy
import pickle
import subprocess
import sys

import pytest
import torch
from torch import nn

from hyperfsdp_core import FSDPModule, fully_shard
from hyperfsdp_core.module import fsdp_class


def class_union():
    a, b = nn.Linear(3, 4), nn.Linear(5, 6)
    seq = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    fully_shard(a)
    fully_shard(b)
    fully_shard(seq)
    out = {
        "name": type(a).__name__,
        "same_class": type(a) is type(b),
        "isinstance": isinstance(a, nn.Linear) and isinstance(a, FSDPModule),
        "mro_head": [c.__name__ for c in type(a).__mro__[:3]],
        "repr": repr(a),
        "class_repr": repr(type(a)),
        "pickled_class": pickle.loads(pickle.dumps(type(a))) is type(a),
        "pickled_seq_class": pickle.loads(pickle.dumps(type(seq))) is type(seq),
        "slice_type": type(seq[0:2]).__name__,  # containers build the original class
        "cached": fsdp_class(nn.Linear) is type(a),
        "module_path": type(a).__module__,
    }
    try:
        copy.deepcopy(a)
        out["deepcopy"] = "allowed"
    except RuntimeError as exc:
        out["deepcopy"] = str(exc)
    return out


def test_class_union(run_ranks):
    (out,) = run_ranks(1, class_union)
    assert out["name"] == "FSDPLinear"
    assert out["same_class"] and out["isinstance"] and out["cached"]
    assert out["mro_head"] == ["FSDPLinear", "FSDPModule", "Linear"]
    assert out["repr"] == "FSDPLinear(in_features=3, out_features=4, bias=True)"
    assert out["class_repr"] == "<class 'torch.nn.modules.linear.FSDPLinear'>"
    assert out["pickled_class"] and out["pickled_seq_class"]
    assert out["slice_type"] == "Sequential"
    assert "state_dict" in out["deepcopy"]


def test_unioned_class_unpickles_in_a_fresh_process():
    data = pickle.dumps(fsdp_class(nn.Linear))
    code = (
        "import pickle, sys; cls = pickle.loads(sys.stdin.buffer.read()); "
        "print(cls.__name__, cls.__mro__[2].__name__, cls.__mro__[1].__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], input=data, capture_output=True, check=True)
    assert out.stdout.decode().split() == ["FSDPLinear", "Linear", "FSDPModule"]


MIXIN_MODULE = """
import abc


class Marker:
    def marked(self):
        return "marked"


class Sizer(abc.ABC):  # a mixin with its own metaclass
    def size_hint(self):
        return 7
"""


def test_unioned_class_with_plugin_mixins_unpickles_in_a_fresh_process(tmp_path, monkeypatch):
    (tmp_path / "union_mixins.py").write_text(MIXIN_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import union_mixins

    cls = fsdp_class(nn.Linear, (union_mixins.Marker, union_mixins.Sizer))
    assert pickle.loads(pickle.dumps(cls)) is cls
    assert type(cls).__name__ == "FSDPUnionedABCMeta"  # the mixin's metaclass wins
    code = (
        f"import pickle, sys; sys.path.insert(0, {str(tmp_path)!r}); "
        "cls = pickle.loads(sys.stdin.buffer.read()); "
        "from hyperfsdp_core.module import fsdp_class; import union_mixins, torch; "
        "same = cls is fsdp_class(torch.nn.Linear, (union_mixins.Marker, union_mixins.Sizer)); "
        "print(cls.__name__, [c.__name__ for c in cls.__mro__[1:4]], same)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], input=pickle.dumps(cls), capture_output=True, check=True
    )
    assert out.stdout.decode().strip() == (
        "FSDPLinear_Marker_Sizer ['FSDPModule', 'Marker', 'Sizer'] True"
    )


def plan_rows():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 8, bias=False))
    fully_shard(model[0])
    fully_shard(model)
    plan = model.sharding_plan()
    rows = {row.fqn: row for row in plan}
    return {
        "fqns": [row.fqn for row in plan],
        "w0": (
            rows["0.weight"].global_shape,
            rows["0.weight"].local_shape,
            rows["0.weight"].padded_shape,
        ),
        "kind": {row.mesh_kind for row in plan},
        "sizes": {(row.shard_size, row.replicate_size) for row in plan},
        "owners": {row.fqn: row.storage_owner for row in plan},
        "needs_ag": {row.needs_all_gather for row in plan},
        "table": str(plan),
    }


def test_sharding_plan(run_ranks):
    r0, r1 = run_ranks(2, plan_rows)
    assert r0["fqns"] == ["0.weight", "0.bias", "1.weight"]
    assert r0["w0"] == ((5, 3), (3, 3), (3, 3)) and r1["w0"] == ((5, 3), (2, 3), (3, 3))
    assert r0["kind"] == {"FSDP"} and r0["sizes"] == {(2, 1)} and r0["needs_ag"] == {True}
    assert r0["owners"] == {
        "0.weight": "fused_buffer",
        "0.bias": "fused_buffer",
        "1.weight": "all_gather_output",
    }
    lines = r0["table"].splitlines()
    assert lines[0].split()[:4] == ["param", "global", "local", "padded"]
    assert lines[2].split()[:4] == ["0.weight", "5x3", "3x3", "3x3"]
    assert "float32/float32/float32" in lines[2]


@pytest.mark.parametrize("world", [1])
def test_world_one_aliases_storage(run_ranks, world):
    assert run_ranks(world, alias_at_world_one) == [True]


def alias_at_world_one():
    model = nn.Linear(4, 3)
    fully_shard(model)
    model(torch.randn(2, 4))  # root keeps parameters unsharded after forward
    (bucket,) = model._hyperfsdp_state.group.buckets
    w = model._hyperfsdp_state.group.params[0]
    assert str(bucket.storage_owner) == "sharded_storage"
    # the unsharded parameter aliases the sharded storage: no buffer, no copy
    return w.unsharded_param.data_ptr() == w.sharded_param.to_local().data_ptr()
