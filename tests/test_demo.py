"""``hyperfsdp demo`` (``make demo``): its parity check passes on this machine, derives its
tolerance from FSDP2's own gap to the reference, and still fails when the sharded training
is really wrong (gradients summed instead of averaged, stale parameters after a skipped
reshard). The command itself: ``test_features.py::test_demo_command``."""

from __future__ import annotations

import pytest

from hyperfsdp_core.cli import demo

SMALL = {"steps": 8, "layers": 2, "dim": 32, "tied": False, "slack": 4.0}


def run_demo(perturb=None, **overrides):
    cfg = {**SMALL, **overrides}
    result = demo._rank_main(
        cfg["steps"], cfg["layers"], cfg["dim"], cfg["tied"], cfg["slack"], perturb
    )
    return result["ok"], {m: row[3] for m, row in result["parity"].items()}, result["parity"]


def no_gradient_average(model):
    """A sharded training that sums gradients over ranks instead of averaging them."""
    from hyperfsdp_core import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)


def skipped_reshard(model):
    """A sharded training that never reshards: after the first step every unit computes with
    the parameters it gathered then, not the ones the optimizer updated (engine internals,
    patched on this model's units only)."""
    for m in model.modules():
        state = getattr(m, "_hyperfsdp_state", None)
        if state is not None and state.group is not None:
            state.group.reshard = lambda: None
            state.group.reshard_post_forward = lambda: None


@pytest.mark.parametrize("tied", [False, True])
def test_demo_parity_holds(run_ranks, tied):
    for ok, _within, rows in run_ranks(4, run_demo, tied=tied):
        assert ok, rows
        for ours, theirs, tolerance, _ in rows.values():
            assert ours <= tolerance and theirs < tolerance


@pytest.mark.parametrize(
    ("perturb", "caught_by"),
    [(no_gradient_average, "gradient norms"), (skipped_reshard, "losses")],
)
def test_demo_parity_fails_when_training_is_wrong(run_ranks, perturb, caught_by):
    for ok, within, rows in run_ranks(2, run_demo, perturb):
        assert not ok
        assert not within[caught_by], rows
        ours, _theirs, tolerance, _ = rows[caught_by]
        assert ours > 10 * tolerance  # far past it, not a rounding call


def test_tolerance_is_derived_from_fsdp2s_gap():
    floors = {m: 1e-6 for m in demo.METRICS}
    fsdp2 = {"losses": 1e-5, "gradient norms": 0.0, "parameters": 2.4e-4}
    ours = {"losses": 3e-5, "gradient norms": 2e-6, "parameters": 2.4e-4}
    check = demo.parity(ours, fsdp2, floors, slack=4.0)
    assert check["losses"] == (3e-5, 1e-5, 4e-5 + 1e-6, True)
    assert check["gradient norms"][2:] == (1e-6, False)  # FSDP2 exact: only the floor
    assert check["parameters"][3]  # a CPU whose rounding drifts further moves both gaps
