"""One ``test_hook_*`` per hook of ``hyperfsdp_core/hookspecs.py``, each exercising it for real.

Every test runs on 2 CPU ranks. The throwaway plugin is registered in the rank
process, inside the rank function, and unregistered in ``finally``.
"""

from __future__ import annotations

import contextlib
import copy
import itertools

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from hyperfsdp_core import (
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    get_plugin_manager,
    hookimpl,
)
from hyperfsdp_core._mesh_info import fsdp_mesh_info
from hyperfsdp_core._plugins import FIRST_PHASE, Phase
from hyperfsdp_core.testing import run_on_ranks

WORLD = 2
TIMEOUT = 120


# -- helpers (run in the rank processes) -----------------------------------------------------------


@contextlib.contextmanager
def registered(plugin: object, name: str):
    pm = get_plugin_manager()
    pm.register(plugin, name=name)
    try:
        yield pm
    finally:
        pm.unregister(plugin)
    assert pm.get_plugin(name) is None


def make_model(*dims: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(a, b) for a, b in itertools.pairwise(dims)))


def shard_layers_and_root(model: nn.Sequential) -> nn.Sequential:
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model


def full_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """Every parameter's gradient as a full tensor (a collective: call on every rank)."""
    return {
        n: (p.grad.full_tensor() if p.grad is not None else None)
        for n, p in model.named_parameters()
    }


def same_input() -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(1))


# -- init hooks -----------------------------------------------------------------------------------


class RejectingPlugin:
    def __init__(self) -> None:
        self.seen: list = []

    @hookimpl
    def hyperfsdp_validate_unit(self, unit):
        fqns = [fqn for fqn, _ in unit.named_params]
        self.seen.append((fqns, unit.mesh.size(), unit.mesh_was_default))
        raise ValueError(f"hook-test rejects {', '.join(fqns)}: shard them another way")


def rank_validate_unit():
    model = make_model(4, 6, 3)
    params = dict(model.named_parameters())
    values = {n: p.detach().clone() for n, p in params.items()}
    plugin = RejectingPlugin()
    with registered(plugin, "test_validate_unit"), pytest.raises(ValueError) as info:
        fully_shard(model)
    untouched = {
        "class": type(model).__name__,
        "same_params": all(p is params[n] for n, p in model.named_parameters()),
        "plain": all(type(p) is nn.Parameter for p in model.parameters()),
        "values": all(torch.equal(p, values[n]) for n, p in model.named_parameters()),
        "no_state": not any(hasattr(m, "_hyperfsdp_state") for m in model.modules()),
        "no_hooks": not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules()),
    }
    # Unregistered, the same (untouched) module shards fine.
    fully_shard(model)
    after = (type(model).__name__, type(model[0].weight).__name__)
    return str(info.value), plugin.seen, untouched, after


def test_hook_validate_unit():
    for message, seen, untouched, after in run_on_ranks(WORLD, rank_validate_unit, timeout=TIMEOUT):
        assert (
            message
            == "hook-test rejects 0.weight, 0.bias, 1.weight, 1.bias: shard them another way"
        )
        assert seen == [(["0.weight", "0.bias", "1.weight", "1.bias"], WORLD, True)]
        assert untouched == {
            "class": "Sequential",
            "same_params": True,
            "plain": True,
            "values": True,
            "no_state": True,
            "no_hooks": True,
        }
        assert after == ("FSDPSequential", "DTensor")


class MeshPlugin:
    """Weights: the plugin's own FSDP MeshInfo; biases: not sharded (a 1-rank mesh)."""

    def __init__(self, solo_mesh) -> None:
        self.solo = fsdp_mesh_info(solo_mesh)
        self.fsdp = None
        self.calls: list = []

    @hookimpl
    def hyperfsdp_select_mesh_info(self, unit, fqn, param):
        self.calls.append((fqn, type(param).__name__, tuple(param.shape)))
        if fqn.endswith("bias"):
            return self.solo
        if self.fsdp is None:
            self.fsdp = fsdp_mesh_info(unit.mesh)
        return self.fsdp


def rank_select_mesh_info():
    # Every rank must take part in creating the sub-meshes, so build them up front.
    solo = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("dp", "solo"))["solo"]
    model = nn.Sequential(nn.Linear(4, 6))
    torch.manual_seed(0)
    model[0].reset_parameters()
    ref = copy.deepcopy(model)
    plugin = MeshPlugin(solo)
    with registered(plugin, "test_select_mesh_info"):
        fully_shard(model)
    infos = {p.fqn: p.mesh_info for p in model._hyperfsdp_state.group.params}
    plan = [
        (r.fqn, r.shard_size, r.local_shape, r.needs_all_gather, r.storage_owner)
        for r in model.sharding_plan()
    ]
    x = same_input()
    out = model(x)
    out.sum().backward()
    ref_out = ref(x)
    ref_out.sum().backward()
    torch.testing.assert_close(out, ref_out)
    bias_grad_shape = tuple(model[0].bias.grad.to_local().shape)
    grads = full_grads(model)
    for (n, g), (_, rp) in zip(grads.items(), ref.named_parameters()):
        torch.testing.assert_close(g, rp.grad, msg=n)
    return (
        plugin.calls,
        infos["0.weight"] is plugin.fsdp,
        infos["0.bias"] is plugin.solo,
        plan,
        bias_grad_shape,
    )


def test_hook_select_mesh_info():
    for rank, result in enumerate(run_on_ranks(WORLD, rank_select_mesh_info, timeout=TIMEOUT)):
        calls, weight_info_used, bias_info_used, plan, bias_grad_shape = result
        assert calls == [("0.weight", "Parameter", (6, 4)), ("0.bias", "Parameter", (6,))]
        assert weight_info_used and bias_info_used
        assert plan == [
            ("0.weight", 2, (3, 4), True, "all_gather_output"),
            ("0.bias", 1, (6,), False, "sharded_storage"),
        ], f"rank {rank}"
        assert bias_grad_shape == (6,)


class Greeter:
    def greet(self) -> str:
        return f"hello from {type(self).__name__}"


class MixinPlugin:
    def __init__(self) -> None:
        self.units: list = []

    @hookimpl
    def hyperfsdp_module_mixins(self, unit):
        self.units.append([type(m).__name__ for m in unit.modules])
        return [Greeter]


def rank_module_mixins():
    model = make_model(4, 6, 3)
    plugin = MixinPlugin()
    with registered(plugin, "test_module_mixins"):
        shard_layers_and_root(model)
    plain = fully_shard(nn.Linear(2, 2))  # after unregistering: no mixin
    out = model(same_input())
    return {
        "units": plugin.units,
        "names": [type(m).__name__ for m in (model, model[0], model[1])],
        "mro": [c.__name__ for c in type(model[0]).__mro__[:4]],
        "greet": model[1].greet(),
        "same_class": type(model[0]) is type(model[1]),
        "isinstance": isinstance(model[0], FSDPModule) and isinstance(model[0], nn.Linear),
        "plain_mro": [c.__name__ for c in type(plain).__mro__[:3]],
        "plain_differs": type(plain) is not type(model[0]),
        "out_shape": tuple(out.shape),
    }


def test_hook_module_mixins():
    for result in run_on_ranks(WORLD, rank_module_mixins, timeout=TIMEOUT):
        assert result["units"] == [["Linear"], ["Linear"], ["Sequential"]]
        assert all(name.startswith(("FSDPLinear", "FSDPSequential")) for name in result["names"])
        assert result["names"][1].startswith("FSDPLinear")
        assert result["mro"] == [result["names"][1], "FSDPModule", "Greeter", "Linear"]
        assert result["greet"] == f"hello from {result['names'][1]}"
        assert result["same_class"] and result["isinstance"] and result["plain_differs"]
        assert result["plain_mro"] == ["FSDPLinear", "FSDPModule", "Linear"]
        assert result["out_shape"] == (5, 3)


class Bf16WeightsPlugin:
    def __init__(self) -> None:
        self.calls: list = []

    @hookimpl
    def hyperfsdp_param_dtypes(self, unit, param):
        fqn = unit.fqn_of(param)
        self.calls.append(fqn)
        if fqn.endswith("weight"):
            return torch.bfloat16, torch.float32
        return None  # no opinion: the builtin mixed-precision plugin decides


def rank_param_dtypes():
    model = nn.Linear(4, 6)
    ref = copy.deepcopy(model)
    plugin = Bf16WeightsPlugin()
    with registered(plugin, "test_param_dtypes"):
        fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16))
    plan = [(r.fqn, r.orig_dtype, r.param_dtype, r.reduce_dtype) for r in model.sharding_plan()]
    model.unshard()
    unsharded = (model.weight.dtype, model.bias.dtype)
    weight_matches = torch.equal(model.weight, ref.weight.detach().to(torch.bfloat16))
    model.reshard()
    master = (type(model.weight).__name__, model.weight.dtype)
    return plugin.calls, plan, unsharded, weight_matches, master


def test_hook_param_dtypes():
    for calls, plan, unsharded, weight_matches, master in run_on_ranks(
        WORLD, rank_param_dtypes, timeout=TIMEOUT
    ):
        assert calls == ["weight", "bias"]
        assert plan == [
            ("weight", torch.float32, torch.bfloat16, torch.float32),
            ("bias", torch.float32, torch.float16, torch.float16),
        ]
        assert unsharded == (torch.bfloat16, torch.float16)
        assert weight_matches
        assert master == ("DTensor", torch.float32)


# -- forward hooks --------------------------------------------------------------------------------


class InputTransformPlugin:
    """Doubles the root's inputs."""

    def __init__(self) -> None:
        self.states: list = []
        self.applied = 0

    @hookimpl
    def hyperfsdp_forward_input_transform(self, state):
        self.states.append((type(state).__name__, state.fqn, state.is_root))
        if not state.is_root:
            return None

        def double(args, kwargs):
            self.applied += 1
            return tuple(a * 2 for a in args), kwargs

        return double


def rank_forward_input_transform():
    model = make_model(4, 6, 3)
    ref = copy.deepcopy(model)
    plugin = InputTransformPlugin()
    x = same_input()
    with registered(plugin, "test_forward_input_transform"):
        shard_layers_and_root(model)
        calls_before_forward = len(plugin.states)
        out1 = model(x)
        out2 = model(x + 1)
    torch.testing.assert_close(out1, ref(2 * x))
    torch.testing.assert_close(out2, ref(2 * (x + 1)))
    per_unit = [len(m._hyperfsdp_state.input_transforms) for m in (model, model[0], model[1])]
    return calls_before_forward, plugin.states, plugin.applied, per_unit


def test_hook_forward_input_transform():
    for before, states, applied, per_unit in run_on_ranks(
        WORLD, rank_forward_input_transform, timeout=TIMEOUT
    ):
        assert before == 0  # not at fully_shard time: at the root's first forward
        assert sorted(states) == [
            ("FSDPState", "", True),
            ("FSDPState", "0", False),
            ("FSDPState", "1", False),
        ]
        assert applied == 2  # once per forward, by the one unit that returned a callable
        assert per_unit == [1, 0, 0]


class OutputTransformPlugin:
    """Root output + 1; layer 0's output * 3."""

    def __init__(self) -> None:
        self.states: list = []
        self.applied: list = []

    @hookimpl
    def hyperfsdp_forward_output_transform(self, state):
        self.states.append((state.fqn, state.is_root))
        if state.is_root:
            return self._add_one
        if state.fqn == "0":
            return self._triple
        return None

    def _add_one(self, out):
        self.applied.append("root")
        return out + 1

    def _triple(self, out):
        self.applied.append("0")
        return out * 3


def rank_forward_output_transform():
    model = make_model(4, 6, 3)
    ref = copy.deepcopy(model)
    plugin = OutputTransformPlugin()
    x = same_input()
    with registered(plugin, "test_forward_output_transform"):
        shard_layers_and_root(model)
        calls_before_forward = len(plugin.states)
        outs = [model(x), model(x)]
    expected = ref[1](3 * ref[0](x)) + 1
    for out in outs:
        torch.testing.assert_close(out, expected)
    outs[0].sum().backward()  # the transforms are differentiable parts of the graph
    grads = full_grads(model)
    ref_out = ref[1](3 * ref[0](x)) + 1
    ref_out.sum().backward()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, msg=n)
    return calls_before_forward, plugin.states, plugin.applied


def test_hook_forward_output_transform():
    for before, states, applied in run_on_ranks(
        WORLD, rank_forward_output_transform, timeout=TIMEOUT
    ):
        assert before == 0
        assert sorted(states) == [("", True), ("0", False), ("1", False)]
        assert applied == ["0", "root", "0", "root"]


# -- backward hooks -------------------------------------------------------------------------------


class ReducerPlugin:
    def __init__(self, defer_prefix: str | None = None) -> None:
        self.units: list = []
        self.received: list = []
        self.deferred: list = []
        self.defer_prefix = defer_prefix

    @hookimpl
    def hyperfsdp_gradient_reducers(self, state):
        if state.group is None:
            return None
        fqns = [p.fqn for p in state.group.params]
        self.units.append(fqns)
        defer = self.defer_prefix is not None and fqns[0].startswith(self.defer_prefix)

        def reducer(reductions):
            for reduction in reductions:  # one per bucket of this post-backward
                self.received.append(
                    (
                        type(reduction).__name__,
                        [p.fqn for p in reduction.members],
                        reduction.output.numel(),
                        # not applied yet: the reducer may still take the reduction over
                        [p.sharded_param.grad is None for p in reduction.members],
                    )
                )
                if defer:
                    reduction.defer()
                    self.deferred.append(reduction)

        return reducer


def rank_gradient_reducers():
    x = same_input()
    ref = make_model(4, 8, 3)
    ref(x).sum().backward()
    expected = {n: p.grad for n, p in ref.named_parameters()}

    model = make_model(4, 8, 3)
    fully_shard(model[0])
    fully_shard(model)  # the root unit manages layer 1
    plugin = ReducerPlugin()
    with registered(plugin, "test_gradient_reducers"):
        at_fully_shard = len(plugin.units)
        model(x).sum().backward()
        buckets_after_first = sorted(plugin.units)
        received_after_first = sorted(plugin.received)
        grads = full_grads(model)
        model(x).sum().backward()
        calls = (len(plugin.units), len(plugin.received))
    for n, g in grads.items():
        torch.testing.assert_close(g, expected[n], msg=n)

    # A reducer that defers takes the reduction over: the core does not apply it.
    model = make_model(4, 8, 3)
    fully_shard(model[0])
    fully_shard(model)
    deferring = ReducerPlugin(defer_prefix="1.")
    with registered(deferring, "test_gradient_reducers_defer"):
        model(x).sum().backward()
    grads_set = {n: p.grad is not None for n, p in model.named_parameters()}
    deferred_members = [[p.fqn for p in r.members] for r in deferring.deferred]
    for reduction in deferring.deferred:
        reduction.apply()  # what a plugin does later, e.g. after its own all-reduce
    for n, g in full_grads(model).items():
        torch.testing.assert_close(g, expected[n], msg=n)
    return (
        at_fully_shard,
        buckets_after_first,
        received_after_first,
        calls,
        grads_set,
        deferred_members,
    )


def test_hook_gradient_reducers():
    for at_init, buckets, received, calls, grads_set, deferred in run_on_ranks(
        WORLD, rank_gradient_reducers, timeout=TIMEOUT
    ):
        assert at_init == 0  # resolved at lazy init, not at fully_shard
        assert buckets == [["0.weight", "0.bias"], ["1.weight", "1.bias"]]
        # layer 0: (4*4 + 4) local elements; layer 1: 3 rows over 2 ranks -> padded to 2 rows.
        assert received == [
            ("Reduction", ["0.weight", "0.bias"], 4 * 4 + 4, [True, True]),
            ("Reduction", ["1.weight", "1.bias"], 2 * 8 + 2, [True, True]),
        ]
        assert calls == (2, 4)  # resolved once per unit; one reduction per bucket per backward
        assert grads_set == {"0.weight": True, "0.bias": True, "1.weight": False, "1.bias": False}
        assert deferred == [["1.weight", "1.bias"]]


# -- finalize hooks -------------------------------------------------------------------------------


class AfterDrainPlugin:
    def __init__(self) -> None:
        self.runs: list = []

    @hookimpl
    def hyperfsdp_finalize_phases(self):
        return [Phase("test.after_drain", self.run, after=FIRST_PHASE)]

    def run(self, ctx) -> None:
        model = ctx.root.modules[0]
        self.runs.append(
            {
                "ctx": type(ctx).__name__,
                "root_is_model": ctx.root is model._hyperfsdp_state,
                "grads": {
                    n: p.grad.to_local().clone() if isinstance(p.grad, DTensor) else p.grad
                    for n, p in model.named_parameters()
                },
            }
        )


def rank_finalize_phases():
    model = make_model(4, 8, 3)
    plugin = AfterDrainPlugin()
    x = same_input()
    with registered(plugin, "test_finalize_phases") as pm:
        order = [p.name for p in pm.finalization_phases()]
        shard_layers_and_root(model)
        with torch.no_grad():
            model(x)
        runs_after_forward_only = len(plugin.runs)
        model(x).sum().backward()
        first = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
        runs_after_first = len(plugin.runs)
        model(x).sum().backward()  # gradients accumulate
        second = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
    recorded = plugin.runs
    checks = {
        "ctx": [r["ctx"] for r in recorded],
        "root": [r["root_is_model"] for r in recorded],
        "grads_set_at_run": [all(g is not None for g in r["grads"].values()) for r in recorded],
        "first_matches": all(torch.equal(recorded[0]["grads"][n], first[n]) for n in first),
        "second_matches": all(torch.equal(recorded[1]["grads"][n], second[n]) for n in second),
        "accumulated": all(torch.allclose(second[n], 2 * first[n]) for n in first),
    }
    return order, runs_after_forward_only, runs_after_first, len(recorded), checks


def test_hook_finalize_phases():
    for order, after_forward, after_first, total, checks in run_on_ranks(
        WORLD, rank_finalize_phases, timeout=TIMEOUT
    ):
        assert order[0] == FIRST_PHASE
        assert "test.after_drain" in order
        assert after_forward == 0
        assert after_first == 1 and total == 2  # once per backward
        assert checks == {
            "ctx": ["RootContext", "RootContext"],
            "root": [True, True],
            "grads_set_at_run": [True, True],  # the drain ran first
            "first_matches": True,
            "second_matches": True,
            "accumulated": True,
        }


# -- state-dict hooks -----------------------------------------------------------------------------


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
    model = make_model(4, 8, 3)
    shard_layers_and_root(model)
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
    fqns = ["0.weight", "0.bias", "1.weight", "1.bias"]
    for rank, (calls, out_dtype) in enumerate(
        run_on_ranks(WORLD, rank_param_reset, timeout=TIMEOUT)
    ):
        # layer 1's weight has 3 rows: rank 1 owns 1 row, still non-empty
        assert calls["load"] == [("HSDPParam", f, torch.float32, 0.5) for f in fqns], rank
        assert [c[:3] for c in calls["to"]] == [("HSDPParam", f, torch.float64) for f in fqns]
        assert [c[3] for c in calls["to"]] == [0.5] * 4  # values kept, dtype converted
        assert [c[:3] for c in calls["to_empty"]] == [("HSDPParam", f, torch.float64) for f in fqns]
        assert out_dtype == torch.float64
