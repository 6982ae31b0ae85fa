"""Run PyTorch's own FSDP2 unit tests with hyperfsdp's ``fully_shard`` swapped in.

PyTorch's tests (``test/distributed/_composable/fsdp/test_fully_shard_*.py`` of the torch
release installed here) are not shipped in the torch wheel and are not copied into this
repository: fetch them into a directory of your own, then::

    .venv/bin/python -m pip install --target /tmp/fsdp2_deps expecttest   # torch's test helpers need it
    PYTHONPATH=/tmp/fsdp2_deps .venv/bin/python tools/run_fsdp2_upstream.py /tmp/fsdp2_upstream
    PYTHONPATH=/tmp/fsdp2_deps .venv/bin/python tools/run_fsdp2_upstream.py /tmp/fsdp2_upstream --impl fsdp2

Before the test modules are imported, ``fully_shard``, ``FSDPModule``, the policies and the
other public names are replaced by hyperfsdp's in every module that FSDP2's tests import
them from (``torch.distributed.fsdp``, ``torch.distributed.fsdp._fully_shard``,
``torch.distributed.fsdp._fully_shard._fully_shard``, ``torch.distributed._composable.fsdp``
and its ``fully_shard`` module). ``--impl fsdp2`` runs the same files on torch's own FSDP2,
the baseline a hyperfsdp result is compared with. pytest then runs the files on CPU in this
process; each test gets ``--timeout`` seconds (a hang fails it with ``TIMEOUT``). The run
ends with one row per test: outcome and, for a failure or skip, the reason.

Test files newer than the installed torch may import helpers it lacks; the ones known to be
cosmetic (``common_utils.HardwareClassification``, a label) get a stand-in and are listed.
"""

from __future__ import annotations

import argparse
import enum
import importlib
import os
import signal
import sys
import tempfile
import textwrap
from collections.abc import Sequence
from pathlib import Path

import pytest

#: where FSDP2's tests import the public names from
SWAP_MODULES = (
    "torch.distributed.fsdp",
    "torch.distributed.fsdp._fully_shard",
    "torch.distributed.fsdp._fully_shard._fully_shard",
    "torch.distributed._composable.fsdp",
    "torch.distributed._composable.fsdp.fully_shard",
)
#: torch's public FSDP2 names, as the core's use_as_fsdp2 switches them
from hyperfsdp_core._torch_private import FSDP2_NAMES as SWAP_NAMES  # noqa: E402


def swap_in_hyperfsdp() -> list[str]:
    """Bind hyperfsdp's public names where FSDP2's are imported from; the bound names."""
    import hyperfsdp_core

    bound = []
    for module_name in SWAP_MODULES:
        module = importlib.import_module(module_name)
        for name in SWAP_NAMES:
            if name in vars(module) and hasattr(hyperfsdp_core, name):
                setattr(module, name, getattr(hyperfsdp_core, name))
                bound.append(f"{module_name}.{name}")
    return bound


def add_helper_stand_ins() -> list[str]:
    """Stand-ins for cosmetic test helpers that the installed torch does not have yet."""
    try:
        from torch.testing._internal import common_utils
    except ImportError:  # expecttest missing: main() says so; the test files cannot run
        return []
    added = []
    if not hasattr(common_utils, "HardwareClassification"):
        # a label on test classes (which hardware a test needs), nothing reads it on CPU
        common_utils.HardwareClassification = enum.Enum(  # type: ignore[attr-defined]
            "HardwareClassification", ["GENERIC", "GPU", "MULTI_GPU"]
        )
        added.append("torch.testing._internal.common_utils.HardwareClassification")
    return added


#: set in the environment of spawned rank processes (FSDPTest), whose fresh interpreter
#: runs the generated ``sitecustomize`` below before it imports the test module
CHILD_ENV = "HYPERFSDP_FSDP2_UPSTREAM_IMPL"
_SITECUSTOMIZE = """\
import os, sys
if os.environ.get({env!r}):
    sys.path.insert(0, {tools!r})
    import run_fsdp2_upstream
    run_fsdp2_upstream.prepare_process(os.environ[{env!r}])
"""


def prepare_process(impl: str) -> list[str]:
    """Stand-ins, then (``impl == "hyperfsdp"``) the swap; what was done, for the log."""
    notes = [f"stand-in: {name}" for name in add_helper_stand_ins()]
    if impl == "hyperfsdp":
        notes.append(f"hyperfsdp swapped in for {len(swap_in_hyperfsdp())} names")
    return notes


def prepare_children(impl: str, test_dir: Path) -> None:
    """Rank processes spawned by FSDPTest import the test module by name and swap too."""
    site_dir = Path(tempfile.mkdtemp(prefix="fsdp2_upstream_site_"))
    tools = str(Path(__file__).resolve().parent)
    (site_dir / "sitecustomize.py").write_text(_SITECUSTOMIZE.format(env=CHILD_ENV, tools=tools))
    path = [str(site_dir), str(test_dir), os.environ.get("PYTHONPATH", "")]
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
    os.environ[CHILD_ENV] = impl
    sys.path.insert(0, str(test_dir))


class TestTimeout(Exception):
    """A test ran past the per-test limit (likely a hang in a collective)."""


class UpstreamReport:
    """pytest plugin: a per-test time limit, and the outcome and reason of each test."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.rows: dict[str, tuple[str, str]] = {}

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        def expire(signum, frame):
            raise TestTimeout(f"TIMEOUT after {self.timeout:g} s (hang?)")

        previous = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, self.timeout)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)

    def pytest_runtest_logreport(self, report) -> None:
        if report.when != "call" and report.passed:
            return
        if report.nodeid in self.rows and self.rows[report.nodeid][0] != "passed":
            return  # keep the first non-pass (a teardown error after a failure)
        outcome, reason = report.outcome, ""
        if report.skipped and isinstance(report.longrepr, tuple):
            reason = str(report.longrepr[2])
        elif report.failed:
            reason = _failure_reason(report)
            if report.when != "call":
                outcome = f"error ({report.when})"
        self.rows[report.nodeid] = (outcome, reason)

    def table(self) -> str:
        lines = []
        for nodeid, (outcome, reason) in sorted(self.rows.items()):
            lines.append(f"{outcome:8} {nodeid}")
            if reason:
                lines.append(textwrap.indent(textwrap.shorten(reason, 300), " " * 9))
        counts: dict[str, int] = {}
        for outcome, _ in self.rows.values():
            counts[outcome] = counts.get(outcome, 0) + 1
        lines.append(", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items())))
        return "\n".join(lines)


def _failure_reason(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    # MultiThreadedTestCase re-raises a rank thread's failure with the thread's
    # traceback in the message: keep the exception line(s), not the frames
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.split(":")[0].endswith(("Error", "Exception", "Timeout"))]
    return " | ".join(errors[-2:]) if errors else " ".join(lines[-3:])


def run_upstream(
    test_dir: Path, impl: str, timeout: float, pytest_args: Sequence[str] = ()
) -> tuple[int, UpstreamReport]:
    """Run pytest on ``test_dir`` with ``impl`` in place; the exit code and the report."""
    test_dir = test_dir.resolve()
    for note in prepare_process(impl):
        print(note, file=sys.stderr)
    prepare_children(impl, test_dir)
    args = [
        str(test_dir),
        f"--rootdir={test_dir}",
        "-p",
        "no:cacheprovider",
        "--import-mode=importlib",
        "-q",
        "--no-header",
        "-rN",
        *pytest_args,
    ]
    report = UpstreamReport(timeout)
    code = pytest.main(args, plugins=[report])
    print(f"\n== FSDP2's tests on {impl} ==")
    print(report.table())
    return int(code), report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("test_dir", type=Path, help="directory holding test_fully_shard_*.py")
    parser.add_argument(
        "--impl",
        choices=("hyperfsdp", "fsdp2"),
        default="hyperfsdp",
        help="run with hyperfsdp swapped in (default) or on torch's own FSDP2",
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per test")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args(argv)
    try:
        import expecttest  # noqa: F401  (torch.testing._internal.common_utils imports it)
    except ImportError:
        print("torch's test helpers need expecttest: pip install expecttest", file=sys.stderr)
        return 2
    extra = [*(["-k", args.keyword] if args.keyword else []), *args.pytest_args]
    return run_upstream(args.test_dir, args.impl, args.timeout, extra)[0]


if __name__ == "__main__":
    sys.exit(main())
