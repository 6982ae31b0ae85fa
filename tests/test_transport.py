"""The communication seam: ``hyperfsdp_transport`` and ``plugin.Transport``.

The byte-counting transport of docs/plugins.md ("6. A transport") is run as written: the
test executes that very code block, so the example stays true. Every run trains against the
unsharded reference on the global batch (losses and final parameters to fp32 tolerance) and
against torch's FSDP2 carrying its collectives on the same comm objects.
"""

from __future__ import annotations

import collections
import re
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hyperfsdp_core import fully_shard
from hyperfsdp_core.plugin import FIRST_PHASE, Phase, Transport, hookimpl
from hyperfsdp_core.testing import registered
from hyperfsdp_core.testing.reference import (
    Transformer,
    assert_close_params,
    lm_loss,
    local_slice,
    token_batch,
    train_parity,
)

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3
VOCAB = 32
TIMEOUT = 180


def doc_source(title: str) -> str:
    """The code block under ``### <title>`` in docs/plugins.md's "6. A transport"."""
    text = (ROOT / "docs" / "plugins.md").read_text()
    section = text.split("## 6. A transport", 1)[1].split("\n## ", 1)[0]
    part = section.split(f"### {title}\n", 1)[1].split("\n### ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", part, re.DOTALL)
    assert len(blocks) == 1, f"docs/plugins.md: the example {title!r} is missing"
    return blocks[0]


def doc_block(title: str) -> types.ModuleType:
    """The code block under ``### <title>`` executed as a module (the plugin it defines)."""
    module = types.ModuleType(title)
    exec(compile(doc_source(title), f"<docs/plugins.md: {title}>", "exec"), module.__dict__)
    return module


def doc_transport() -> types.ModuleType:
    """The byte-counting transport plugin of docs/plugins.md."""
    return doc_block("Example: counting the bytes each unit moves")


def build() -> Transformer:
    return Transformer(vocab=VOCAB, dim=16, n_layers=2, hidden=24)


def shard(model, impl_fully_shard=fully_shard) -> None:
    for block in model.layers:
        impl_fully_shard(block)
    impl_fully_shard(model)


def batch(step: int):
    return token_batch(step, 8, 5, VOCAB)


class Recorder:
    def __init__(self) -> None:
        self.events: list = []

    @hookimpl
    def hyperfsdp_collective_observer(self, root):
        return self.events.append


class AllReduceInPhase:
    """A plugin phase that all-reduces a tensor through ``root.comm`` for the root unit."""

    def __init__(self) -> None:
        self.sums: list[float] = []

    @hookimpl
    def hyperfsdp_finalize_phases(self):
        return [Phase("test.transport_all_reduce", self.run, after=FIRST_PHASE)]

    def run(self, root) -> None:
        t = torch.full((7,), float(dist.get_rank() + 1))
        root.comm.all_reduce(t, None, unit=root.unit.fqn).wait()
        self.sums.append(t[0].item())


def rank_counting_transport():
    plugin = doc_transport()
    recorder, phase = Recorder(), AllReduceInPhase()
    with (
        registered(plugin, "doc_transport"),
        registered(recorder, "recorder"),
        registered(phase, "all_reduce_phase"),
    ):
        result = train_parity(build, shard, batch, lm_loss, steps=STEPS)
    observed = collections.Counter()
    for e in recorder.events:
        observed[(e.unit, e.kind)] += e.nbytes
    world = dist.get_world_size()
    assert phase.sums == [world * (world + 1) / 2] * STEPS
    return dict(plugin.BYTES), dict(observed), result["losses"]


def rank_fsdp2_on_the_same_comms():
    """torch's FSDP2 with the doc's comm objects as its custom all-gather / reduce-scatter."""
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    plugin = doc_transport()
    torch.manual_seed(0)
    model = build()
    shard(model, fsdp2_fully_shard)
    for name, module in [("layers.0", model.layers[0]), ("layers.1", model.layers[1]), ("", model)]:
        unit = types.SimpleNamespace(fqn=name)
        module.set_custom_all_gather(plugin.CountingAllGather(unit))
        module.set_custom_reduce_scatter(plugin.CountingReduceScatter(unit))
    losses = train_steps(model)
    return dict(plugin.BYTES), losses


def train_steps(model) -> list[float]:
    """Train the sharded ``model`` STEPS steps on the global batch; the losses averaged over
    the ranks."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        loss = lm_loss(model(local_slice(x)), local_slice(y))
        loss.backward()
        opt.step()
        opt.zero_grad()
        avg = loss.detach().float().clone()
        dist.all_reduce(avg)
        losses.append(avg.item() / dist.get_world_size())
    return losses


@pytest.mark.parametrize("world", [2, 4])
def test_hook_transport(run_ranks, world):
    """The doc's counting transport carries every all-gather and reduce-scatter of every unit
    and the plugins' all-reduces for a unit (``root.comm`` with ``unit=``): its byte counts
    are the collectives the core issued, per unit, and training matches the reference and
    FSDP2 on the same comm objects."""
    ours = run_ranks(world, rank_counting_transport, timeout=TIMEOUT)
    theirs = run_ranks(world, rank_fsdp2_on_the_same_comms, timeout=TIMEOUT)
    for (counted, observed, losses), (fsdp2_counted, fsdp2_losses) in zip(ours, theirs):
        assert counted == observed  # every collective the core issued went through it
        for unit in ("layers.0", "layers.1", ""):
            assert counted[(unit, "all_gather")] > 0
            assert counted[(unit, "reduce_scatter")] > 0
        assert counted[("", "all_reduce")] == STEPS * 7 * 4
        # the same collectives as FSDP2 issues on the same comm objects (fp32, no padding)
        assert {k: v for k, v in counted.items() if k[1] != "all_reduce"} == fsdp2_counted
        torch.testing.assert_close(losses, fsdp2_losses, atol=1e-5, rtol=1e-4)


class RowsTransport(Transport):
    """A transport written from the docs' optional interface: gathers dim-0 buckets straight
    into the rows of the unsharded buffer (``gather_route`` -> ``"rows"``)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows_calls = self.native_calls = 0

    def gather_route(self, group, nbytes, rows):
        return "rows" if rows else "native"

    def all_gather_rows(self, rows, rank, group):
        self.rows_calls += 1
        for view in rows:
            gathered = torch.empty_like(view)
            dist.all_gather_into_tensor(gathered.view(-1), view[rank].contiguous(), group=group)
            view.copy_(gathered)
        return None  # done in the call

    def all_gather(self, output, input, group, async_op):
        self.native_calls += 1
        return super().all_gather(output, input, group, async_op)


class RowsPlugin:
    def __init__(self) -> None:
        self.transport = RowsTransport()

    @hookimpl
    def hyperfsdp_transport(self, unit):
        return self.transport


def rank_rows_transport():
    plugin = RowsPlugin()
    with registered(plugin, "rows_transport"):
        train_parity(build, shard, batch, lm_loss, steps=STEPS)
    return plugin.transport.rows_calls, plugin.transport.native_calls


def test_a_transport_subclass_picks_the_route(run_ranks):
    for rows_calls, native_calls in run_ranks(2, rank_rows_transport, timeout=TIMEOUT):
        # 3 units, each gathered in forward and backward (the root is kept) every step
        assert rows_calls > 0 and native_calls == 0


def rank_custom_over_plugin():
    """``set_custom_all_gather`` takes precedence over the plugin's transport for the unit's
    all-gathers; its reduce-scatters stay the plugin's."""
    plugin = doc_transport()

    class Custom(plugin.CountingAllGather):
        calls = 0

        def __call__(self, output, input, group, async_op=False):
            Custom.calls += 1
            return dist.all_gather_into_tensor(output, input, group=group, async_op=async_op)

    torch.manual_seed(0)
    model = build()
    ref = build()
    ref.load_state_dict(model.state_dict())
    with registered(plugin, "doc_transport"):
        shard(model)
        model.layers[1].set_custom_all_gather(Custom(None))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
        for step in range(STEPS):
            x, y = batch(step)
            lm_loss(model(local_slice(x)), local_slice(y)).backward()
            lm_loss(ref(x), y).backward()
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
    assert_close_params(model, ref)
    return Custom.calls, dict(plugin.BYTES)


def test_custom_comm_takes_precedence_over_the_plugin_transport(run_ranks):
    for custom_calls, counted in run_ranks(2, rank_custom_over_plugin, timeout=TIMEOUT):
        assert custom_calls == 2 * STEPS  # layers.1: forward and backward all-gathers
        assert ("layers.1", "all_gather") not in counted
        assert counted[("layers.1", "reduce_scatter")] > 0
        assert counted[("layers.0", "all_gather")] > 0


# -- bf16 on the wire (the second example of docs/plugins.md) ---------------------------------


BF16 = "Example: bf16 on the wire"


def doc_bf16() -> types.ModuleType:
    return doc_block(BF16)


def test_the_bf16_transport_of_the_docs_is_small():
    """A compressing transport written from the docs fits in 50 lines of code (blank lines
    and comments not counted) and declares the plugin API that has ``report_wire``."""
    lines = doc_source(BF16).splitlines()
    assert len([ln for ln in lines if ln.strip() and not ln.strip().startswith("#")]) <= 50
    assert doc_bf16().HYPERFSDP_API == ">=1.1,<2"


def train_observed(plugin, *, mp: bool = False) -> tuple[list[float], list]:
    """Train the sharded model STEPS steps (``plugin`` registered unless None); the losses
    (averaged over ranks) and every collective event the observers saw."""
    from contextlib import nullcontext

    from hyperfsdp_core import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(torch.bfloat16, torch.bfloat16) if mp else MixedPrecisionPolicy()
    recorder = Recorder()
    transport = registered(plugin, "bf16_wire") if plugin is not None else nullcontext()
    with registered(recorder, "recorder"), transport:
        torch.manual_seed(0)
        model = build()
        for block in model.layers:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        losses = train_steps(model)
    return losses, recorder.events


def rank_bf16_wire():
    plugin = doc_bf16()
    wire_losses, wire_events = train_observed(plugin)
    losses, events = train_observed(None)
    # registered, but every collective is bf16 already (mixed precision): passed on as it is
    mp_wire_losses, mp_wire_events = train_observed(plugin, mp=True)
    mp_losses, _ = train_observed(None, mp=True)
    return wire_losses, wire_events, losses, events, mp_wire_losses, mp_wire_events, mp_losses


@pytest.mark.parametrize("world", [2, 4])
def test_a_bf16_transport_from_the_docs_halves_the_wire_bytes(run_ranks, world):
    """The doc's bf16 transport: the observers see every fp32 all-gather and reduce-scatter
    twice as large as what went on the wire (bf16), the losses stay within 8e-4 relative of
    fp32 collectives, and collectives that are bf16 already pass unchanged (same bits)."""
    for out in run_ranks(world, rank_bf16_wire, timeout=TIMEOUT):
        wire_losses, wire_events, losses, events, mp_wire_losses, mp_wire_events, mp_losses = out
        kinds = collections.Counter(e.kind for e in wire_events)
        assert kinds["all_gather"] > 0 and kinds["reduce_scatter"] > 0
        # the same collectives (in another order: the default CPU transport, hyperfsdp-shm,
        # gathers in line and is not prefetched)
        assert sorted((e.kind, e.unit, e.nbytes) for e in wire_events) == sorted(
            (e.kind, e.unit, e.nbytes) for e in events
        )
        for e in wire_events:
            assert e.dtype == torch.float32 and e.wire_dtype == torch.bfloat16
            assert 2 * e.wire_nbytes == e.nbytes
        for e in events + mp_wire_events:  # nothing reported: the wire is the logical one
            assert (e.wire_nbytes, e.wire_dtype) == (e.nbytes, e.dtype)
        assert {e.dtype for e in mp_wire_events} == {torch.bfloat16}
        torch.testing.assert_close(wire_losses, losses, rtol=8e-4, atol=0)
        assert wire_losses != losses  # the wire did round
        assert mp_wire_losses == mp_losses


def test_report_wire_is_seen_only_inside_a_collective():
    from hyperfsdp_core.comm.records import observed_event, wire_reports
    from hyperfsdp_core.plugin import report_wire

    report_wire(torch.zeros(3))  # outside a collective: nothing to tell, nothing raised
    fp32 = torch.zeros(8)
    with wire_reports() as outer:
        report_wire(torch.zeros(8, dtype=torch.bfloat16))
        with wire_reports() as inner:
            report_wire(torch.zeros(2, dtype=torch.int8), torch.zeros(2, dtype=torch.bfloat16))
        report_wire(torch.zeros(4, dtype=torch.bfloat16))
    event = observed_event(("all_gather", "layers.0", fp32, None), 2, outer)
    assert (event.nbytes, event.dtype, event.unit) == (32, torch.float32, "layers.0")
    assert (event.wire_nbytes, event.wire_dtype) == (24, torch.bfloat16)
    mixed = observed_event(("reduce_scatter", "", fp32, None), 2, inner)
    assert (mixed.wire_nbytes, mixed.wire_dtype) == (6, None)
    plain = observed_event(("all_reduce", None, fp32, None), 2, [])
    assert (plain.wire_nbytes, plain.wire_dtype) == (32, torch.float32)


class WaitedWork:
    """A work object a transport returns even where the core passes ``async_op=False``;
    records the stream current at each ``wait()``."""

    waits: list[str] = []

    def __init__(self, work, sim) -> None:
        self.work, self.sim = work, sim

    def wait(self) -> None:
        WaitedWork.waits.append(self.sim.current_stream().name)
        self.work.wait()


def rank_bf16_wire_on_an_accelerator():
    """The doc's bf16 transport on the accelerator code path (streams simulated on CPU), and
    a transport that always returns work: the core waits for it once per collective, on the
    communication stream that issued it."""
    from hyperfsdp_core.testing.streams import simulated_accelerator

    plugin = doc_bf16()
    with simulated_accelerator() as sim:
        wire_losses, wire_events = train_observed(plugin)
    bf16_violations = list(sim.violations)

    class ReturnsWork(Transport):
        def all_gather(self, output, input, group, async_op):
            return WaitedWork(plugin.all_gather(output, input, group=group, async_op=True), sim)

        def reduce_scatter(self, output, input, group, op, async_op, *, scratch_input=False):
            work = plugin.reduce_scatter(output, input, op=op, group=group, async_op=True)
            return WaitedWork(work, sim)

    returns_work = types.SimpleNamespace(hyperfsdp_transport=hookimpl(lambda unit: ReturnsWork()))
    WaitedWork.waits = []
    with simulated_accelerator() as sim:
        losses, events = train_observed(returns_work)
    return (
        bf16_violations,
        wire_losses,
        wire_events,
        sim.violations,
        losses,
        events,
        WaitedWork.waits,
    )


def test_the_contract_on_the_accelerator_path(run_ranks):
    for out in run_ranks(2, rank_bf16_wire_on_an_accelerator, timeout=TIMEOUT):
        bf16_violations, wire_losses, wire_events, violations, losses, events, waits = out
        assert bf16_violations == [] and violations == []
        assert all(2 * e.wire_nbytes == e.nbytes for e in wire_events)
        torch.testing.assert_close(wire_losses, losses, rtol=8e-4, atol=0)
        kinds = collections.Counter(e.kind for e in events)
        assert collections.Counter(waits) == {
            "all_gather": kinds["all_gather"],
            "reduce": kinds["reduce_scatter"],
        }
