"""``test_hook_*`` for the backward and finalize hooks, each exercised for real on 2 CPU ranks."""

from __future__ import annotations

import itertools

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hyperfsdp_core import fully_shard
from hyperfsdp_core.plugin import FIRST_PHASE, Phase, hookimpl
from hyperfsdp_core.testing import registered, run_on_ranks
from hyperfsdp_core.testing.counting import CollectiveCounter

WORLD = 2
TIMEOUT = 120


def make_model(*dims: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(a, b) for a, b in itertools.pairwise(dims)))


def full_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {
        n: (p.grad.full_tensor() if p.grad is not None else None)
        for n, p in model.named_parameters()
    }


def reference_grads(*dims: int) -> dict[str, torch.Tensor]:
    ref = make_model(*dims)
    ref(same_input()).sum().backward()
    return {n: p.grad for n, p in ref.named_parameters()}


def same_input() -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(1))


def layer0_and_root(model: nn.Sequential) -> nn.Sequential:
    fully_shard(model[0])
    fully_shard(model)  # the root unit manages layer 1
    return model


# -- gradient reducers ----------------------------------------------------------------------------


class ReducerPlugin:
    """Records what reducers see; defers layer 1's reductions (releases them on request)."""

    def __init__(self, defer_prefix: str | None = None, consume_prefix: str | None = None) -> None:
        self.units: list = []
        self.received: list = []
        self.deferred: list = []
        self.consumed: list = []
        self.defer_prefix = defer_prefix
        self.consume_prefix = consume_prefix

    @hookimpl
    def hyperfsdp_gradient_reducers(self, unit):
        fqns = [p.fqn for p in unit.params]
        self.units.append(fqns)

        def reducer(reductions):
            for red in reductions:  # one per bucket of this post-backward
                names = [p.fqn for p in red.params]
                w = red.params[0]
                self.received.append(
                    (
                        type(red).__name__,
                        red.unit.fqn,
                        names,
                        red.output.numel(),
                        red.reduce_dtype,
                        red.mesh_info.kind,
                        # not landed yet: the reducer may still hold the reduction
                        [p.sharded_param.grad is None for p in red.params],
                        tuple(red.grad_of(w).shape) == w.local_shape,
                        red.key == (tuple(red.params), red.reduce_dtype),
                    )
                )
                if self.defer_prefix and names[0].startswith(self.defer_prefix):
                    red.defer()
                    self.deferred.append(red)
                if self.consume_prefix and names[0].startswith(self.consume_prefix):
                    self.consumed.append(red.consume().clone())

        return reducer


def rank_gradient_reducers():
    expected = reference_grads(4, 8, 3)
    x = same_input()
    model = layer0_and_root(make_model(4, 8, 3))
    plugin = ReducerPlugin()
    with registered(plugin, "test_gradient_reducers"):
        at_fully_shard = len(plugin.units)
        model(x).sum().backward()
        units_after_first = sorted(plugin.units)
        received_after_first = sorted(plugin.received, key=lambda r: r[1])
        grads = full_grads(model)
        model(x).sum().backward()
        calls = (len(plugin.units), len(plugin.received))
    for n, g in grads.items():
        torch.testing.assert_close(g, expected[n], msg=n)

    # defer(): the reduction does not land until released
    model = layer0_and_root(make_model(4, 8, 3))
    deferring = ReducerPlugin(defer_prefix="1.")
    with registered(deferring, "test_gradient_reducers_defer"):
        model(x).sum().backward()
    held = {n: p.grad is not None for n, p in model.named_parameters()}
    for red in deferring.deferred:
        red.release()  # what a plugin does later, e.g. after its own all-reduce
    for n, g in full_grads(model).items():
        torch.testing.assert_close(g, expected[n], msg=n)
    try:
        deferring.deferred[0].release()
        over_release = "allowed"
    except RuntimeError as exc:
        over_release = str(exc)

    # consume(): the reduction never lands; the plugin has its output
    model = layer0_and_root(make_model(4, 8, 3))
    consuming = ReducerPlugin(consume_prefix="0.")
    with registered(consuming, "test_gradient_reducers_consume"):
        model(x).sum().backward()
    consumed = {n: p.grad is not None for n, p in model.named_parameters()}
    w = model[0].weight
    taken = consuming.consumed[0][: w.to_local().numel()].view(w.to_local().shape)
    torch.testing.assert_close(
        taken, expected["0.weight"].chunk(WORLD)[torch.distributed.get_rank()]
    )
    return (
        at_fully_shard,
        units_after_first,
        received_after_first,
        calls,
        held,
        over_release,
        consumed,
    )


def test_hook_gradient_reducers():
    for at_init, units, received, calls, held, over_release, consumed in run_on_ranks(
        WORLD, rank_gradient_reducers, timeout=TIMEOUT
    ):
        assert at_init == 0  # resolved at lazy init, not at fully_shard
        assert units == [["0.weight", "0.bias"], ["1.weight", "1.bias"]]
        # layer 0: (4*4 + 4) local elements; layer 1: 3 rows over 2 ranks -> padded to 2 rows.
        f32 = torch.float32
        assert received == [
            ("Reduction", "", ["1.weight", "1.bias"], 2 * 8 + 2, f32, "FSDP", [1, 1], 1, 1),
            ("Reduction", "0", ["0.weight", "0.bias"], 4 * 4 + 4, f32, "FSDP", [1, 1], 1, 1),
        ]
        assert calls == (2, 4)  # resolved once per unit; one reduction per bucket per backward
        assert held == {"0.weight": True, "0.bias": True, "1.weight": False, "1.bias": False}
        assert over_release == "Reduction.release() called more often than defer()"
        assert consumed == {"0.weight": False, "0.bias": False, "1.weight": True, "1.bias": True}


# -- gradient landing -----------------------------------------------------------------------------


class HalvingLanding:
    """Lands every reduced shard halved, and records what it was given."""

    def __init__(self) -> None:
        self.units: list = []
        self.landed: list = []

    @hookimpl
    def hyperfsdp_grad_landing(self, unit):
        self.units.append(unit.fqn)

        def land(param, shard):
            self.landed.append((param.fqn, tuple(shard.shape) == param.local_shape))
            return shard * 0.5

        return land


def rank_grad_landing():
    expected = reference_grads(4, 8, 3)
    model = layer0_and_root(make_model(4, 8, 3))
    plugin = HalvingLanding()
    with registered(plugin, "test_grad_landing"):
        model(same_input()).sum().backward()
    for n, g in full_grads(model).items():
        torch.testing.assert_close(g, expected[n] * 0.5, msg=n)
    return sorted(plugin.units), sorted(plugin.landed)


def test_hook_grad_landing():
    for units, landed in run_on_ranks(WORLD, rank_grad_landing, timeout=TIMEOUT):
        assert units == ["", "0"]
        assert landed == [(n, True) for n in ("0.bias", "0.weight", "1.bias", "1.weight")]


# -- finalize hooks -------------------------------------------------------------------------------


class AfterDrainPlugin:
    def __init__(self) -> None:
        self.runs: list = []

    @hookimpl
    def hyperfsdp_finalize_phases(self):
        return [Phase("test.after_drain", self.run, after=FIRST_PHASE)]

    def run(self, root) -> None:
        model = root.unit.modules[0]
        self.runs.append(
            {
                "root": type(root).__name__,
                "units": [u.fqn for u in root.units],
                "is_last": root.is_last_backward,
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
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
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
        "root": [r["root"] for r in recorded],
        "units": recorded[0]["units"],
        "is_last": [r["is_last"] for r in recorded],
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
            "root": ["RootView", "RootView"],
            "units": ["", "0", "1"],
            "is_last": [True, True],
            "grads_set_at_run": [True, True],  # the drain ran first
            "first_matches": True,
            "second_matches": True,
            "accumulated": True,
        }


class Recorder:
    """Records every collective event of the roots it is asked about."""

    def __init__(self) -> None:
        self.roots: list = []
        self.events: list = []

    @hookimpl
    def hyperfsdp_collective_observer(self, root):
        self.roots.append(len(root.units))
        return self.events.append


def rank_collective_observer():
    model = make_model(4, 8, 3)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    plugin = Recorder()
    x = same_input()
    with registered(plugin, "test_collective_observer"):
        with CollectiveCounter() as counter:
            model(x).sum().backward()
        first = list(plugin.events)
        model(x).sum().backward()  # resolved once: the same observer keeps recording
    events = [(e.kind, e.group_size, e.nbytes, e.dtype, e.unit) for e in first]
    return plugin.roots, events, counter.calls, len(plugin.events)


def test_hook_collective_observer():
    for roots, events, counted, total in run_on_ranks(
        WORLD, rank_collective_observer, timeout=TIMEOUT
    ):
        assert roots == [3]  # once per root, at its lazy init
        f32 = torch.float32
        # layer 0: 8x4+8 elements, even; layer 1: 3 rows -> 2 per rank (2x8+2) x 2 ranks
        ag0 = ("all_gather", 2, (8 * 4 + 8) * 4, f32, "0")
        ag1 = ("all_gather", 2, (2 * 8 + 2) * 2 * 4, f32, "1")
        rs0 = ("reduce_scatter", 2, (8 * 4 + 8) * 4, f32, "0")
        rs1 = ("reduce_scatter", 2, (2 * 8 + 2) * 2 * 4, f32, "1")
        # forward gathers, then backward re-gathers and reduces each layer in turn (the
        # collectives run in line through shared memory: nothing is prefetched)
        assert events == [ag0, ag1, ag1, rs1, ag0, rs0]
        assert [k for k, _, _ in counted] == ["ag", "ag", "ag", "rs", "ag", "rs"]
        assert total == 12


def rank_observer_sees_plugin_collectives():
    """Plugins' collectives through ``root.comm`` are observed too, labelled by unit."""
    model = make_model(4, 8, 3)
    fully_shard(model)
    recorder = Recorder()

    class AllReduceGrads:
        @hookimpl
        def hyperfsdp_finalize_phases(self):
            return [Phase("test.all_reduce", self.run, after=FIRST_PHASE)]

        def run(self, root):
            grad = root.unit.params[0].sharded_param.grad.to_local()
            root.comm.all_reduce(grad, None, unit=root.unit.fqn).wait()

    expected = reference_grads(4, 8, 3)["0.weight"]
    with registered(recorder, "test_observer"), registered(AllReduceGrads(), "test_ar"):
        model(same_input()).sum().backward()
    chunks = expected.chunk(WORLD)  # the weight is even: every rank's shard has one shape
    torch.testing.assert_close(model[0].weight.grad.to_local(), sum(chunks))
    return [(e.kind, e.unit) for e in recorder.events]


def test_plugin_comm_all_reduce_is_observed():
    for events in run_on_ranks(WORLD, rank_observer_sees_plugin_collectives, timeout=TIMEOUT):
        assert events == [("all_gather", ""), ("reduce_scatter", ""), ("all_reduce", "")]


def rank_reducer_holds_compose():
    """Two plugins defer the same reduction; it lands once, after both released it."""
    expected = reference_grads(4, 8, 3)
    model = layer0_and_root(make_model(4, 8, 3))
    first, second = ReducerPlugin(defer_prefix="0."), ReducerPlugin(defer_prefix="0.")
    with registered(first, "test_first"), registered(second, "test_second"):
        model(same_input()).sum().backward()
    red = first.deferred[0]
    assert red is second.deferred[0] and red.holds == 2  # the core released its own
    states = [model[0].weight.grad is None]
    red.release()
    states.append(model[0].weight.grad is None)
    assert red.holds == 1
    red.release()
    states.append(model[0].weight.grad is None)
    assert red.holds == 0
    torch.testing.assert_close(model[0].weight.grad.full_tensor(), expected["0.weight"])
    return states


def test_reduction_lands_after_the_last_hold():
    for states in run_on_ranks(WORLD, rank_reducer_holds_compose, timeout=TIMEOUT):
        assert states == [True, True, False]
