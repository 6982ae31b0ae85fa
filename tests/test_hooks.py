"""``test_hook_*`` for the init and forward hooks of ``hyperfsdp_core/hookspecs.py``.

Every test exercises its hook for real on 2 CPU ranks, with a throwaway plugin
registered in the rank process (``hyperfsdp_core.testing.registered``). Backward and
finalize hooks: ``test_hooks_backward.py``; state-dict and plan hooks:
``test_hooks_state_dict.py``; the command-line hook: ``test_cli.py``.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module

from hyperfsdp_core import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from hyperfsdp_core.plugin import ParamLayout, ShardedStorage, fsdp_mesh_info, hookimpl
from hyperfsdp_core.testing import registered, run_on_ranks

WORLD = 2
TIMEOUT = 120


# -- helpers (run in the rank processes) -----------------------------------------------------------


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


class LayoutPlugin:
    """Layer 0's weight gets a layout with observable callables: ``unwrap_grad`` doubles
    its gradient, so that weight's gradient is twice the reference's."""

    def __init__(self) -> None:
        self.calls: list = []
        self.wraps: list = []
        self.unwraps = 0

    @hookimpl
    def hyperfsdp_param_layout(self, unit, fqn, param, mesh_info, shard_dim):
        self.calls.append((fqn, shard_dim, mesh_info.shard_size))
        if fqn != "0.weight":
            return None  # the core's default layout

        def wrap(tensor):
            self.wraps.append(tuple(tensor.shape))
            return tensor

        def unwrap(grad):
            self.unwraps += 1
            return grad * 2

        return ParamLayout(
            tensor=param.detach(),
            mesh=mesh_info.mesh,
            placements=(Shard(0),),
            global_shape=param.shape,
            wrap_unsharded=wrap,
            unwrap_grad=unwrap,
        )


def rank_param_layout():
    model = make_model(4, 6, 3)
    ref = copy.deepcopy(model)
    plugin = LayoutPlugin()
    x = same_input()
    with registered(plugin, "test_param_layout"):
        fully_shard(model)
        for _ in range(2):
            model(x).sum().backward()
    for _ in range(2):
        ref(x).sum().backward()
    grads = full_grads(model)
    for n, p in ref.named_parameters():
        expected = p.grad * 2 if n == "0.weight" else p.grad
        torch.testing.assert_close(grads[n], expected, msg=n)
    return plugin.calls, plugin.wraps, plugin.unwraps


def test_hook_param_layout():
    for calls, wraps, unwraps in run_on_ranks(WORLD, rank_param_layout, timeout=TIMEOUT):
        # asked once per parameter at fully_shard time, FQNs relative to the unit
        assert calls == [("0.weight", 0, 2), ("0.bias", 0, 2), ("1.weight", 0, 2), ("1.bias", 0, 2)]
        assert wraps == [(6, 4)]  # once, when the unsharded parameter is created
        assert unwraps == 2  # once per backward


class DTensorLayoutPlugin:
    """Shards parameters that are already DTensors (on a size-1 "tp" dim of a (dp, tp) mesh):
    the TP-local tensor is sharded over "dp", the module computes with TP DTensors."""

    def __init__(self, mesh) -> None:
        self.mesh = mesh
        self.seen: list = []

    @hookimpl
    def hyperfsdp_select_mesh_info(self, unit, fqn, param):
        return fsdp_mesh_info(unit.mesh) if isinstance(param, DTensor) else None

    @hookimpl
    def hyperfsdp_param_layout(self, unit, fqn, param, mesh_info, shard_dim):
        if not isinstance(param, DTensor):
            return None
        self.seen.append((fqn, type(param).__name__, tuple(param.placements)))
        tp_mesh, tp_placements = param.device_mesh, param.placements
        return ParamLayout(
            tensor=param.to_local(),
            mesh=self.mesh,
            placements=(Shard(0), *tp_placements),
            global_shape=param.shape,
            wrap_unsharded=lambda t: DTensor.from_local(t, tp_mesh, tp_placements, run_check=False),
            unwrap_grad=lambda g: g.to_local(),
        )


def rank_param_layout_dtensor_params():
    mesh = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("dp", "tp"))
    model = make_model(4, 6)
    ref = copy.deepcopy(model)

    def to_dtensor(mod, args, m):
        return tuple(DTensor.from_local(a, m, (Replicate(),), run_check=False) for a in args)

    distribute_module(
        model, mesh["tp"], input_fn=to_dtensor, output_fn=lambda mod, o, m: o.to_local()
    )
    before = list(model.parameters())
    plugin = DTensorLayoutPlugin(mesh)
    x = same_input()
    with registered(plugin, "test_param_layout_dtensor"):
        fully_shard(model, mesh=mesh["dp"])
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for _ in range(2):
            model(x).sum().backward()
            ref(x).sum().backward()
            opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(dict(model.named_parameters())[n].full_tensor(), p, msg=n)
    after = dict(model.named_parameters())
    return (
        plugin.seen,
        {n: (p.device_mesh.mesh_dim_names, tuple(p.placements)) for n, p in after.items()},
        any(p is q for p in before for q in after.values()),
        [(b.device_mesh.mesh_dim_names, b.to_local().shape) for b in before],
    )


def test_hook_param_layout_replaces_dtensor_parameters():
    """A layout plugin may shard parameters that are DTensors already (tensor parallelism):
    the core registers new sharded DTensor Parameters and leaves the originals as they were."""
    for seen, after, reused, originals in run_on_ranks(
        WORLD, rank_param_layout_dtensor_params, timeout=TIMEOUT
    ):
        assert seen == [
            ("0.weight", "DTensor", (Replicate(),)),
            ("0.bias", "DTensor", (Replicate(),)),
        ]
        assert after == {
            "0.weight": (("dp", "tp"), (Shard(0), Replicate())),
            "0.bias": (("dp", "tp"), (Shard(0), Replicate())),
        }
        assert not reused
        assert originals == [(("tp",), (6, 4)), (("tp",), (6,))]


class HostStoragePlugin:
    """Answers for units with a CPUOffloadPolicy: sharded storage on the host."""

    def __init__(self) -> None:
        self.units: list = []

    @hookimpl
    def hyperfsdp_sharded_storage(self, unit):
        if not isinstance(unit.offload_policy, CPUOffloadPolicy):
            return None
        self.units.append([fqn for fqn, _ in unit.named_params])
        return ShardedStorage(torch.device("cpu"), pin_memory=False)


def rank_sharded_storage():
    model = make_model(4, 6, 3)
    ref = copy.deepcopy(model)
    plugin = HostStoragePlugin()
    policy = CPUOffloadPolicy(pin_memory=False)
    with registered(plugin, "test_sharded_storage"):
        for layer in model:
            fully_shard(layer, offload_policy=policy)
        fully_shard(model)  # the root without offload: the hook is asked, answers None
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        x = same_input()
        for _ in range(2):
            model(x).sum().backward()
            ref(x).sum().backward()
            opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(dict(model.named_parameters())[n].full_tensor(), p, msg=n)
    devices = {p.to_local().device.type for p in model.parameters()}
    return plugin.units, devices


def test_hook_sharded_storage():
    for units, devices in run_on_ranks(WORLD, rank_sharded_storage, timeout=TIMEOUT):
        assert units == [["weight", "bias"], ["weight", "bias"]]
        assert devices == {"cpu"}


# -- forward hooks --------------------------------------------------------------------------------


class InputTransformPlugin:
    """Doubles the root's inputs."""

    def __init__(self) -> None:
        self.states: list = []
        self.applied = 0

    @hookimpl
    def hyperfsdp_forward_input_transform(self, unit):
        self.states.append((type(unit).__name__, unit.fqn, unit.is_root))
        if not unit.is_root:
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
            ("UnitView", "", True),
            ("UnitView", "0", False),
            ("UnitView", "1", False),
        ]
        assert applied == 2  # once per forward, by the one unit that returned a callable
        assert per_unit == [1, 0, 0]


class OutputTransformPlugin:
    """Root output + 1; layer 0's output * 3."""

    def __init__(self) -> None:
        self.states: list = []
        self.applied: list = []

    @hookimpl
    def hyperfsdp_forward_output_transform(self, unit):
        self.states.append((unit.fqn, unit.is_root))
        if unit.is_root:
            return self._add_one
        if unit.fqn == "0":
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


class DoublingInput:
    """Produces every all-gather input as twice the sharded storage."""

    def __init__(self) -> None:
        self.units: list = []
        self.fills: list = []

    @hookimpl
    def hyperfsdp_all_gather_input(self, unit):
        self.units.append(unit.fqn)

        def fill(sharded, dest):
            self.fills.append((unit.fqn, sharded.numel(), dest.numel(), dest.dtype))
            torch.mul(sharded, 2, out=dest)

        return fill


def rank_all_gather_input():
    model = make_model(4, 6, 3)
    doubled = copy.deepcopy(model)
    with torch.no_grad():
        for p in doubled.parameters():
            p.mul_(2)
    plugin = DoublingInput()
    x = same_input()
    with registered(plugin, "test_all_gather_input"):
        shard_layers_and_root(model)
        with torch.no_grad():
            out = model(x)
    torch.testing.assert_close(out, doubled(x))  # the forward used the fill's output
    masters = {n: p.full_tensor() for n, p in model.named_parameters()}
    for n, p in make_model(4, 6, 3).named_parameters():  # the master weights are untouched
        torch.testing.assert_close(masters[n], p, msg=n)
    return sorted(plugin.units), plugin.fills


def test_hook_all_gather_input():
    for units, fills in run_on_ranks(WORLD, rank_all_gather_input, timeout=TIMEOUT):
        assert units == ["0", "1"]  # once per unit that manages parameters, at lazy init
        # one fill per all-gather: each layer's padded slot (6x4+6 -> 3x4+3; 3x6+3 -> 2x6+2)
        assert fills == [
            ("0", 15, 15, torch.float32),
            ("1", 14, 14, torch.float32),
        ]
