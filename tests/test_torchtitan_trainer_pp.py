"""examples/torchtitan_trainer_pp.py, small: torchtitan's Trainer with pipeline parallelism and
hyperfsdp gives FSDP2's losses and gradient norms. torchtitan is not a dependency (not in CI);
tests/test_pipelining.py drives torch's pipelining directly."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_torchtitan_trainer_pipeline_gives_fsdp2_losses():
    pytest.importorskip("torchtitan")
    pytest.importorskip("tyro")
    pytest.importorskip("torchdata")  # torchtitan's dataloader base class
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
        str(ROOT / "examples" / "torchtitan_trainer_pp.py"),
        "--schedule", "1F1B", "--steps", "2", "--layers", "2", "--seq", "16",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [line.split() for line in out.stdout.splitlines() if line[:4].strip().isdigit()]
    assert len(rows) == 2, out.stdout
    assert all(row[1] == row[2] and row[3] == row[4] for row in rows), out.stdout
