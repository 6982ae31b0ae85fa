"""Streams and events on accelerators, checked on a simulated device on CPU
(``hyperfsdp_core.testing.streams``): every collective of the accelerator code path is
ordered exactly as it needs to be -- after the writes it reads (the optimizer step, the
copy-in) and after the last use of memory it writes into -- and ``set_post_optim_event``
makes the next forward's all-gathers wait for that event, not for the whole stream."""

import copy

import pytest
import torch
import torch.distributed as dist

from hyperfsdp_core import MixedPrecisionPolicy, fully_shard
from hyperfsdp_core.testing.reference import (
    Transformer,
    assert_close_params,
    lm_loss,
    local_slice,
    token_batch,
)
from hyperfsdp_core.testing.streams import simulated_accelerator

VOCAB, SEQ = 37, 8


def _shard(model, mp: bool, post_forward: int | None) -> None:
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if mp else MixedPrecisionPolicy()
    raf = True if post_forward is None else post_forward
    for layer in model.layers:  # several members: gathered into a staging buffer
        fully_shard(layer, mp_policy=policy, reshard_after_forward=raf)
    # one dim-0 member: gathered straight into the unsharded parameter's storage (the
    # last unit of the forward: nothing else orders its post-forward shard for backward)
    fully_shard(model.output, mp_policy=policy, reshard_after_forward=raf)
    fully_shard(model, mp_policy=policy)


def train_on_simulator(
    mode: str, *, mp: bool = False, post_forward: int | None = None, steps: int = 3
) -> dict:
    """Train the sharded model beside an unsharded reference with every ``Comm`` on the
    simulated device. ``mode``:

    - ``"event"``: ``set_post_optim_event`` after each optimizer step, then more work
      on the current stream (the next forward's all-gathers must not wait for it);
    - ``"stream"``: no event (the all-gathers wait for the whole current stream), and
      at one step an explicit ``unshard()`` between the optimizer step and the forward;
    - ``"early_event"``: a user error, the event recorded *before* the optimizer step;
    - ``"no_release"``: as ``"event"``, with ``Comm.release_gathered`` doing nothing.
    """
    from hyperfsdp_core.comm import Comm

    release = Comm.release_gathered
    if mode == "no_release":
        Comm.release_gathered = lambda self: None
    try:
        with simulated_accelerator() as sim:
            torch.manual_seed(0)
            model = Transformer(vocab=VOCAB, dim=16, n_layers=3, n_heads=2, hidden=24)
            ref = copy.deepcopy(model)
            _shard(model, mp, post_forward)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
            losses, ref_losses, first_gathers, marks = [], [], [], []
            for step in range(steps):
                x, y = token_batch(step, 2 * dist.get_world_size(), SEQ, VOCAB)
                mark = sim.ops
                loss = lm_loss(model(local_slice(x)), local_slice(y))
                # the forward's first all-gather (the root's)
                first_gathers.append(
                    next(c for c in sim.collectives if c[0] > mark and "allgather" in c[1])
                )
                loss.backward()
                ref_loss = lm_loss(ref(x), y)
                ref_loss.backward()
                if mode == "early_event":
                    event = sim.current_stream().record_event()
                opt.step()
                opt.zero_grad()
                ref_opt.step()
                ref_opt.zero_grad()
                if mode == "stream" and step == 0:  # outside any pass: waits for everything
                    model.unshard()
                if mode in ("event", "no_release"):
                    event = sim.current_stream().record_event()
                if mode != "stream":
                    model.set_post_optim_event(event)
                # work queued after the event: logging, a metric, the next batch
                after = sim.default.enqueue()
                marks.append((event.clock if mode != "stream" else None, after))
                if step == 1:  # evaluation between steps (takes the event, if any)
                    with torch.no_grad():
                        model(local_slice(x))
                    if mode != "stream":
                        model.set_post_optim_event(sim.current_stream().record_event())
                    marks[-1] = (marks[-1][0], sim.default.enqueue())
                avg = loss.detach().clone()
                dist.all_reduce(avg)
                losses.append(avg.item() / dist.get_world_size())
                ref_losses.append(ref_loss.item())
            if not mp:
                assert_close_params(model, ref, atol=1e-5, rtol=1e-4)
            default = sim.default
            # was each forward's first all-gather ordered after the previous step's
            # optimizer (the event) and after the work queued past the event?
            order = []
            for (_, _, _, clock), (event_clock, after) in zip(first_gathers[1:], marks):
                seen = clock.get(default, 0)
                order.append(
                    (
                        None if event_clock is None else seen >= event_clock[default],
                        seen >= after[default],
                    )
                )
            streams = {c[2] for c in sim.collectives if "allgather" in c[1]}
            return {
                "violations": sim.violations,
                "losses": losses,
                "ref_losses": ref_losses,
                "order": order,
                "gather_streams": sorted(streams),
                "ops": sim.ops,
            }
    finally:
        Comm.release_gathered = release


def _close(a: list[float], b: list[float], tol: float) -> bool:
    return all(abs(x - y) <= tol * max(1.0, abs(y)) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("world", [2, 4])
def test_post_optim_event_orders_the_next_all_gathers_after_it_only(run_ranks, world):
    for out in run_ranks(world, train_on_simulator, "event", timeout=240):
        assert out["violations"] == []
        assert _close(out["losses"], out["ref_losses"], 1e-5), out
        assert out["gather_streams"] == ["all_gather"]
        # after the optimizer (the event), not after the work queued past it
        assert out["order"] == [(True, False)] * 2


def test_without_an_event_all_gathers_wait_for_the_whole_stream(run_ranks):
    for out in run_ranks(2, train_on_simulator, "stream", timeout=240):
        assert out["violations"] == []
        assert _close(out["losses"], out["ref_losses"], 1e-5), out
        assert out["order"] == [(None, True)] * 2


@pytest.mark.parametrize(
    "kwargs, world",
    [({"mp": True}, 2), ({"post_forward": 2}, 4)],
    ids=["bf16-copy-in", "post-forward-mesh"],
)
def test_copy_in_and_post_forward_gathers_are_ordered(run_ranks, kwargs, world):
    for out in run_ranks(world, train_on_simulator, "event", timeout=240, **kwargs):
        assert out["violations"] == []
        tol = 2e-2 if kwargs.get("mp") else 1e-5  # bf16 parameters: bf16 tolerance
        assert _close(out["losses"], out["ref_losses"], tol), out
        assert out["order"] == [(True, False)] * 2


def test_the_simulator_catches_a_missing_release(run_ranks):
    """Without ``release_gathered``, memory an all-gather wrote into goes back to the
    all-gather stream's pool while the current stream may still read it."""
    out = run_ranks(2, train_on_simulator, "no_release", steps=2, timeout=240)[0]
    assert any("is freed while current may still use it" in v for v in out["violations"])


def test_the_simulator_catches_an_event_recorded_before_the_optimizer(run_ranks):
    """A user error the simulator must see: all-gathers that read parameters the
    optimizer is still writing."""
    out = run_ranks(2, train_on_simulator, "early_event", steps=2, timeout=240)[0]
    assert any("on all_gather reads memory that aten." in v for v in out["violations"]), out[
        "violations"
    ][:5]


def test_the_simulator_forgets_writes_into_freed_memory():
    """A side stream's output is a write the other streams must wait for while its memory
    lives. Once it is freed, the host allocator may hand its address to memory allocated
    where the simulator does not look (a collective's own buffer: gloo's
    ``reduce_scatter_tensor`` on torch 2.11 copies out of one at ``wait()``), and reading
    that is not reading the old write. A live output read without a wait still is one."""
    from hyperfsdp_core._torch_private import modes_set_aside

    with simulated_accelerator() as sim:
        side = sim.Stream()
        x = torch.ones(4096)
        reused = 0
        for _ in range(20):
            with sim.stream(side):
                out = x.to(torch.bfloat16)
            start, end = out.data_ptr(), out.data_ptr() + out.nbytes
            del out
            with modes_set_aside():  # memory the simulator does not see allocated
                unseen = torch.empty(4096, dtype=torch.bfloat16)
            reused += start < unseen.data_ptr() + unseen.nbytes and unseen.data_ptr() < end
            unseen.clone()  # on the current stream
        assert reused, "the host allocator never handed a freed output's memory back"
        assert sim.violations == []
        with sim.stream(side):
            live = x.to(torch.bfloat16)
        live.clone()  # no wait for the side stream
        assert len(sim.violations) == 1, sim.violations
        assert "clone.default on current reads memory that aten._to_copy" in sim.violations[0]
