"""A memory timeline of one training step: heap in use over time, with markers.

``record_step`` runs one (untimed) training step on a rank while a thread samples the
bytes malloc has in use (``mallinfo2``, as ``measure.HeapPeak``) and hooks mark

- ``fwd``: each block's forward start (before its FSDP pre-forward: the all-gather wait
  is inside the block's interval), and the root's (``root``: the model's forward);
- ``bwd``: each block's backward start (the gradient of its output arrives, before the
  FSDP pre-backward hook runs), and the root's (``root``: ``loss.backward()`` is called);
- ``phase``: ``zero_grad``, ``backward end``, ``optimizer`` (``optimizer.step()``
  starts), ``step end``;
- ``coll``: every collective issued through ``torch.distributed``'s Python API (name
  and bytes; issue time, not completion).

Samples are ``(seconds from the step's start, bytes in use, resident bytes)``.
``summarize`` says where the peak is.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from functools import partial

#: marker kinds that delimit the step's phases (``coll`` markers do not)
PHASE_KINDS = ("fwd", "bwd", "phase")


class Markers:
    """Timestamped events; each also takes a heap sample (``probe``) on the calling thread,
    so the timeline has a point at every marker even while the sampler waits for the GIL."""

    def __init__(self, probe=None) -> None:
        self.events: list[tuple[float, str, str]] = []
        self.probe = probe

    def mark(self, kind: str, label: str) -> None:
        if self.probe is not None:
            self.probe()
        self.events.append((time.perf_counter(), kind, label))


def _fwd_pre(markers: Markers, label: str, module, args) -> None:
    markers.mark("fwd", label)


def _fwd_post(markers: Markers, label: str, module, args, output) -> None:
    import torch

    if isinstance(output, torch.Tensor) and output.requires_grad:
        output.register_hook(partial(_bwd, markers, label))


def _bwd(markers: Markers, label: str, grad):
    markers.mark("bwd", label)
    return None


def install_markers(model, markers: Markers) -> list:
    """Forward/backward-start markers on every block and the root; returns the hook handles.

    Registered in front of the FSDP hooks (``prepend=True``), so a block's interval
    includes its unshard wait; the output hook is registered before FSDP's pre-backward
    hook on the same tensor, so it fires first.
    """
    inner = getattr(model, "module", model)  # DDP wraps the model
    handles = [inner.register_forward_pre_hook(partial(_fwd_pre, markers, "root"), prepend=True)]
    for i, layer in enumerate(inner.layers):
        label = f"L{i}"
        handles.append(
            layer.register_forward_pre_hook(partial(_fwd_pre, markers, label), prepend=True)
        )
        handles.append(
            layer.register_forward_hook(partial(_fwd_post, markers, label), prepend=True)
        )
    return handles


def record_step(built, batch, counter=None, interval: float = 0.0005) -> dict:
    """One training step of ``built`` (``impls.Built``) on ``batch``, sampled and marked."""
    import sys

    from .measure import HeapPeak

    heap = HeapPeak(interval, record=True)
    markers = Markers(heap.sample if heap.available else None)
    handles = install_markers(built.model, markers)
    if counter is not None:
        counter.listener = lambda name, nbytes: markers.mark("coll", f"{name} {nbytes}")
    tokens, targets = batch
    switch = sys.getswitchinterval()
    sys.setswitchinterval(interval / 2)  # let the sampler in between Python-heavy stretches
    try:
        t0 = time.perf_counter()
        with heap:
            markers.mark("phase", "zero_grad")
            built.optimizer.zero_grad(set_to_none=True)
            with built.autocast():
                loss = built.model(tokens, targets)
            markers.mark("bwd", "root")
            loss.backward()
            markers.mark("phase", "backward end")
            markers.mark("phase", "optimizer")
            built.optimizer.step()
            markers.mark("phase", "step end")
            value = float(loss.detach())
    finally:
        sys.setswitchinterval(switch)
        for h in handles:
            h.remove()
        if counter is not None:
            counter.listener = None
    samples = [(round(t - t0, 5), b, rss) for t, b, rss in sorted(heap.samples or [])]
    return {
        "loss": value,
        "samples": samples,
        "markers": [(round(t - t0, 5), kind, label) for t, kind, label in markers.events],
        "peak_bytes": heap.peak,
    }


# -- analysis (pure: unit-tested) ------------------------------------------------------------


def phase_of(markers: Sequence[Sequence], t: float) -> str:
    """The phase a time falls in: the last phase marker at or before ``t`` (``"start"``)."""
    label = "start"
    for mt, kind, name in markers:
        if mt > t:
            break
        if kind in PHASE_KINDS:
            label = f"{kind} {name}" if kind != "phase" else name
    return label


def section_of(markers: Sequence[Sequence], t: float) -> str:
    """``forward``, ``backward`` or ``optimizer`` (``zero_grad`` before the forward)."""
    section = "zero_grad"
    for mt, kind, name in markers:
        if mt > t:
            break
        if kind == "fwd":
            section = "forward"
        elif kind == "bwd":
            section = "backward"
        elif kind == "phase" and name == "optimizer":
            section = "optimizer"
        elif kind == "phase" and name == "step end":
            section = "end"
    return section


def summarize(timeline: dict) -> dict:
    """Where one rank's step peaks: bytes, time, phase, and the peak of each section."""
    samples = timeline.get("samples") or []
    markers = timeline.get("markers") or []
    if not samples:
        return {}
    t_peak, peak = max(samples, key=lambda s: s[1])[:2]
    sections: dict[str, int] = {}
    for sample in samples:
        sec = section_of(markers, sample[0])
        sections[sec] = max(sections.get(sec, 0), sample[1])
    rss = [s[2] for s in samples if len(s) > 2 and s[2] is not None]
    return {
        "rss_start_bytes": rss[0] if rss else None,
        "rss_peak_bytes": max(rss) if rss else None,
        "start_bytes": samples[0][1],
        "end_bytes": samples[-1][1],
        "peak_bytes": peak,
        "peak_t": t_peak,
        "peak_phase": phase_of(markers, t_peak),
        "peak_section": section_of(markers, t_peak),
        "section_peaks": sections,
        "step_s": samples[-1][0],
        "collectives_issued_before_peak": [
            label for mt, kind, label in markers if kind == "coll" and mt <= t_peak
        ][-3:],
    }
