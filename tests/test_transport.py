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


def doc_transport() -> types.ModuleType:
    """The transport plugin of docs/plugins.md, executed from the doc."""
    text = (ROOT / "docs" / "plugins.md").read_text()
    section = text.split("## 6. A transport", 1)[1].split("\n## ", 1)[0]
    blocks = [b for b in re.findall(r"```python\n(.*?)```", section, re.DOTALL) if "hookimpl" in b]
    assert len(blocks) == 1, "docs/plugins.md: the transport example is missing"
    module = types.ModuleType("doc_transport")
    exec(compile(blocks[0], "<docs/plugins.md: transport>", "exec"), module.__dict__)
    return module


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
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        loss = lm_loss(model(local_slice(x)), local_slice(y))
        loss.backward()
        opt.step()
        opt.zero_grad()
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        losses.append(avg.item() / dist.get_world_size())
    return dict(plugin.BYTES), losses


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
