"""``test_hook_*`` for the state-dict and sharding-plan hooks, exercised for real on 2 CPU ranks."""

from __future__ import annotations

import itertools

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hyperfsdp_core import fully_shard
from hyperfsdp_core.plugin import hookimpl
from hyperfsdp_core.testing import registered, run_on_ranks

WORLD = 2
TIMEOUT = 120
FQNS = ["0.weight", "0.bias", "1.weight", "1.bias"]


def make_model(*dims: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(a, b) for a, b in itertools.pairwise(dims)))


def sharded_model() -> nn.Sequential:
    model = make_model(4, 8, 3)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model


def same_input() -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(1))


class StateDictPlugin:
    def __init__(self, convert_prefix: str | None = None) -> None:
        self.calls: list = []
        self.convert_prefix = convert_prefix

    @hookimpl
    def hyperfsdp_state_dict_pre_save(self, unit):
        registered = [type(p).__name__ for m in unit.modules for p in m.parameters(recurse=False)]
        self.calls.append(("pre_save", unit.fqn, registered))

    @hookimpl
    def hyperfsdp_state_dict_post_load(self, unit):
        self.calls.append(("post_load", unit.fqn, [p.fqn for p in unit.params]))

    @hookimpl
    def hyperfsdp_load_convert(self, param, value):
        self.calls.append(("convert", param.fqn, type(value).__name__))
        if self.convert_prefix is None or not param.fqn.startswith(self.convert_prefix):
            return None
        # e.g. a checkpoint that stored this parameter negated
        local = (-value).narrow(0, param.shard_offset, param.local_shape[0])
        return DTensor.from_local(
            local,
            param.device_mesh,
            param.placements,
            shape=value.shape,
            stride=value.stride(),
            run_check=False,
        )


def rank_state_dict_pre_save():
    model = sharded_model()
    model(same_input())  # the root keeps its parameters unsharded after forward
    plugin = StateDictPlugin()
    with registered(plugin, "test_pre_save"):
        keys = list(model.state_dict())
    return plugin.calls, keys


def test_hook_state_dict_pre_save():
    for calls, keys in run_on_ranks(WORLD, rank_state_dict_pre_save, timeout=TIMEOUT):
        # once per unit, outermost first; the root was resharded before (DTensors registered)
        assert calls == [
            ("pre_save", "", []),
            ("pre_save", "0", ["DTensor", "DTensor"]),
            ("pre_save", "1", ["DTensor", "DTensor"]),
        ]
        assert keys == FQNS


def rank_load_convert():
    x = same_input()
    full = {k: v.detach().clone() + 1 for k, v in make_model(4, 8, 3).state_dict().items()}
    expected = make_model(4, 8, 3)
    expected.load_state_dict(full)

    # the core's default: a plain full tensor becomes this rank's shard (any world size)
    model = sharded_model()
    model(x)  # lazy init: parameters know their names in the root
    plugin = StateDictPlugin()
    with registered(plugin, "test_load_convert"):
        model.load_state_dict(full)
    converted = [c for c in plugin.calls if c[0] == "convert"]
    torch.testing.assert_close(model(x), expected(x))

    # a plugin's conversion goes first
    model = sharded_model()
    model(x)
    negating = StateDictPlugin(convert_prefix="1.")
    with registered(negating, "test_load_convert_negate"):
        model.load_state_dict(full)
    with torch.no_grad():
        expected[1].weight.neg_(), expected[1].bias.neg_()
    torch.testing.assert_close(model(x), expected(x))

    # sharded values (the model's own state dict) need no conversion
    quiet = StateDictPlugin()
    with registered(quiet, "test_load_convert_quiet"):
        model.load_state_dict(model.state_dict())
    return converted, [c for c in quiet.calls if c[0] == "convert"]


def test_hook_load_convert():
    for converted, quiet in run_on_ranks(WORLD, rank_load_convert, timeout=TIMEOUT):
        assert converted == [("convert", fqn, "Tensor") for fqn in FQNS]
        assert quiet == []


def rank_state_dict_post_load():
    model = sharded_model()
    model(same_input())  # lazy init: units know their names in the root
    sd = {k: v.detach() * 2 for k, v in model.state_dict().items()}
    plugin = StateDictPlugin()
    with registered(plugin, "test_post_load"):
        model.load_state_dict(sd)
    return [c for c in plugin.calls if c[0] == "post_load"]


def test_hook_state_dict_post_load():
    for calls in run_on_ranks(WORLD, rank_state_dict_post_load, timeout=TIMEOUT):
        # once per unit, innermost first (torch runs load post-hooks bottom-up)
        assert calls == [
            ("post_load", "0", ["0.weight", "0.bias"]),
            ("post_load", "1", ["1.weight", "1.bias"]),
            ("post_load", "", []),
        ]


class ResetPlugin:
    def __init__(self) -> None:
        self.calls: list = []

    @hookimpl
    def hyperfsdp_param_reset(self, param):
        local = param.sharded_param.to_local()
        self.calls.append(
            (
                type(param).__name__,
                param.fqn,
                local.dtype,
                float(local.detach().flatten()[0]) if local.numel() else None,
            )
        )


def rank_param_reset():
    model = sharded_model()
    x = same_input()
    model(x).sum().backward()  # lazy init done: FQNs are the root's
    plugin = ResetPlugin()
    calls = {}
    with registered(plugin, "test_param_reset"):
        sd = model.state_dict()
        new = {k: torch.full_like(v, 0.5) for k, v in sd.items()}
        model.load_state_dict(new, assign=True)
        calls["load"], plugin.calls = plugin.calls, []
        loaded_out = model(x).detach()
        model.to(torch.float64)
        calls["to"], plugin.calls = plugin.calls, []
        out64 = model(x.double())
        model.to_empty(device="cpu")
        calls["to_empty"], plugin.calls = plugin.calls, []
    ref = make_model(4, 8, 3)
    with torch.no_grad():
        for p in ref.parameters():
            p.fill_(0.5)
    torch.testing.assert_close(loaded_out, ref(x))  # the loaded values are the ones used
    return calls, out64.dtype


def test_hook_param_reset():
    for rank, (calls, out_dtype) in enumerate(
        run_on_ranks(WORLD, rank_param_reset, timeout=TIMEOUT)
    ):
        # layer 1's weight has 3 rows: rank 1 owns 1 row, still non-empty
        assert calls["load"] == [("ParamView", f, torch.float32, 0.5) for f in FQNS], rank
        assert [c[:3] for c in calls["to"]] == [("ParamView", f, torch.float64) for f in FQNS]
        assert [c[3] for c in calls["to"]] == [0.5] * 4  # values kept, dtype converted
        assert [c[:3] for c in calls["to_empty"]] == [("ParamView", f, torch.float64) for f in FQNS]
        assert out_dtype == torch.float64


class ColumnsPlugin:
    @hookimpl
    def hyperfsdp_plan_columns(self, param):
        return {
            "rows_here": param.local_shape[0],
            "tp_replicate_axis": "tp" if param.fqn.endswith("bias") else None,
        }


class MoreColumns:
    @hookimpl
    def hyperfsdp_plan_columns(self, param):
        return {"padding": param.padded_shape[0] - param.local_shape[0]}


def rank_plan_columns():
    model = sharded_model()
    with registered(ColumnsPlugin(), "test_columns"), registered(MoreColumns(), "test_more"):
        plan = model.sharding_plan()
    plain = model.sharding_plan()
    rows = {row.fqn: (row.extra, row.tp_replicate_axis) for row in plan}
    return rows, str(plan).splitlines(), plain[0].extra, str(plain).splitlines()[0]


def test_hook_plan_columns():
    results = run_on_ranks(WORLD, rank_plan_columns, timeout=TIMEOUT)
    for rank, (rows, lines, plain_extra, plain_header) in enumerate(results):
        weight_rows = 1 if rank else 2  # layer 1's weight: 3 rows over 2 ranks
        assert rows["1.weight"] == (
            (("rows_here", weight_rows), ("tp_replicate_axis", None), ("padding", 2 - weight_rows)),
            None,
        )
        assert rows["1.bias"][1] == "tp"
        assert lines[0].split()[-3:] == ["rows_here", "tp_replicate_axis", "padding"]
        assert lines[2].split()[-3:] == ["4", "-", "0"]  # 0.weight: 8 rows, 4 here
        assert plain_extra == () and "rows_here" not in plain_header


def rank_padded_shard():
    model = sharded_model()  # layer 1: 3 rows over 2 ranks -> rank 1 holds 1 row + 1 padding
    view = model[1]._hyperfsdp_state.group.params[0].view  # the engine's own view (a test)
    slot = view.padded_shard()
    local = model[1].weight.to_local()
    rows = view.local_shape[0]
    result = {
        "shape": tuple(slot.shape) == view.padded_shape,
        "actual": torch.equal(slot[:rows], local),
        "padding_zero": not slot[rows:].count_nonzero(),
    }
    view._hyperfsdp_param.padded_slot[rows:].fill_(7)  # corrupt the padding (engine access)
    result["sees_corruption"] = rows == view.padded_shape[0] or bool(
        view.padded_shard()[rows:].eq(7).all()
    )
    result["is_a_copy"] = view.padded_shard().data_ptr() != local.data_ptr()
    return result


def test_param_view_padded_shard_is_a_copy_of_the_slot():
    for out in run_on_ranks(WORLD, rank_padded_shard, timeout=TIMEOUT):
        assert out == {
            "shape": True,
            "actual": True,
            "padding_zero": True,
            "sees_corruption": True,
            "is_a_copy": True,
        }
