"""The prepared GPU check (``benchmarks/gpu_check.py``, ``make gpu-check``) cannot rot: its
``--device cpu`` dry run (gloo, tiny models, the same cases and report as on a GPU) runs
here, and its checks fail on results that disagree."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cpu_dry_run_writes_a_report_whose_checks_pass(tmp_path):
    report = tmp_path / "report.md"
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--device",
            "cpu",
            "--report",
            str(report),
            "--budget",
            "400",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = report.read_text()
    for case in ("real", "fake", "fake-uneven", "compiled"):
        for impl in ("hyperfsdp", "fsdp2"):
            assert f"| {case} | {impl} |" in text
    assert "- [x] hyperfsdp against FSDP2: losses bit for bit" in text
    assert "- [x] compiled blocks: losses bit for bit" in text
    assert "- [ ]" not in text  # every check held
    # bytes copied per step are counted for both implementations, by operator
    assert '"copied_bytes_by_op"' in text and "fsdp.all_gather_copy_in.default" in text


def test_checks_fail_on_results_that_disagree():
    gc = _module()
    same = {"losses": [1.0, 0.5], "losses_hex": [(1.0).hex(), (0.5).hex()]}
    off = {"losses": [1.0, 0.5000001], "losses_hex": [(1.0).hex(), (0.5000001).hex()]}
    results = {"real/hyperfsdp": off, "real/fsdp2": same, "real/fsdp2-again": same}
    verdict = {what: ok for what, ok, _ in gc.checks(results)}
    assert verdict["FSDP2 against itself: losses bit for bit"]
    assert not verdict["hyperfsdp against FSDP2: losses bit for bit"]
    copies = {
        "fake/hyperfsdp": {"copied_bytes_per_step": 10},
        "fake/fsdp2": {"copied_bytes_per_step": 9},
    }
    assert not dict((w, ok) for w, ok, _ in gc.checks(copies))[
        "fake: hyperfsdp copies fewer bytes per step"
    ]
    failed_case = {"real/hyperfsdp": {"error": "RuntimeError: boom"}, "real/fsdp2": same}
    assert not dict((w, ok) for w, ok, _ in gc.checks(failed_case))[
        "hyperfsdp against FSDP2: losses bit for bit"
    ]
