"""Installed as users install it: ``make dist`` wheels into a fresh virtual environment.

The fresh environment reuses this interpreter's torch (and the few packages the
wheels depend on) through a ``.pth`` file that points at a folder holding only those
distributions, so pip sees them installed and needs no index; hyperfsdp and its
plugins come from the wheels alone (``--no-index``). From that install: the plugins
load, a 2-rank smoke run goes through each, and the ``hyperfsdp`` command works. The
benchmark suite (``benchmarks/``, hyperfsdp-bench) is not among ``make dist``'s wheels: built
apart and installed, it adds ``hyperfsdp bench`` as a plugin adds a command.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: distributions the wheels need from outside (torch's requirements follow)
REUSED = ("torch", "pluggy", "attrs", "numpy", "tqdm", "safetensors")
EXTRAS = {
    name.split("-", 1)[1]: name
    for name in (
        "hyperfsdp-hsdp",
        "hyperfsdp-tp",
        "hyperfsdp-offload",
        "hyperfsdp-dcp",
        "hyperfsdp-shm",
        "hyperfsdp-qcomm",
    )
}
TIMEOUT = 600


def _requirement_closure(names) -> list[importlib.metadata.Distribution]:
    seen: dict[str, importlib.metadata.Distribution] = {}
    todo = list(names)
    while todo:
        name = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # optional (numpy, safetensors) or platform-specific
        seen[key] = dist
        for req in dist.requires or ():
            if "extra ==" in req:
                continue
            todo.append(re.match(r"[A-Za-z0-9._-]+", req)[0])
    return list(seen.values())


def _reuse_folder(folder: Path) -> Path:
    """Symlinks to the reused distributions' files (top-level entries of each)."""
    folder.mkdir()
    for dist in _requirement_closure(REUSED):
        base = Path(dist.locate_file(""))
        tops = {Path(f).parts[0] for f in dist.files or () if not str(f).startswith("..")}
        for top in tops:
            src, dst = base / top, folder / top
            if src.exists() and not dst.exists() and top != "__pycache__":
                dst.symlink_to(src)
    return folder


def _built_once(tmp_path_factory, name: str, build) -> Path:
    """``build(folder)`` once per test session, its folder shared by the xdist workers (the
    first to come builds; the others wait and reuse it). One lock for every build: they
    share the copy of the source tree, and setuptools builds inside it."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the session's folder, above each worker's own
    folder = base / name
    with open(base / "test_install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / ".built").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            (folder / ".built").touch()
    return folder


def _copy_source(folder: Path) -> None:
    # setuptools builds in the source tree: build from a copy of it, never in the checkout
    shutil.copytree(
        ROOT,
        folder / "hyperfsdp",
        ignore=shutil.ignore_patterns(
            ".git", ".venv*", "dist", "build", "*.egg-info", "__pycache__", "results"
        ),
    )


def _build(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


@pytest.fixture(scope="session")
def source(tmp_path_factory) -> Path:
    return _built_once(tmp_path_factory, "source", _copy_source) / "hyperfsdp"


@pytest.fixture(scope="session")
def wheels(source, tmp_path_factory) -> Path:
    """``make dist``'s wheels (the core's and every plugin's)."""
    make = ["make", "-s", "-C", str(source), "wheels", f"PY={sys.executable}"]
    return _built_once(tmp_path_factory, "dist", lambda out: _build([*make, f"DIST_DIR={out}"]))


@pytest.fixture(scope="session")
def bench_wheel(source, tmp_path_factory) -> Path:
    """The benchmark suite's wheel, built apart from ``make dist``'s (from the same copy)."""
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
             str(source / "benchmarks")]  # fmt: skip
    return _built_once(tmp_path_factory, "bench_dist", lambda out: _build([*build, "-w", str(out)]))


def _fresh_env(tmp: Path, wheels: Path, requirement: str) -> Path:
    env = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    python = env / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (Path(site) / "reused.pth").write_text(str(_reuse_folder(tmp / "reused")) + "\n")
    install = [
        sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
        "--no-index", "--find-links", str(wheels), requirement,
    ]  # fmt: skip
    subprocess.run(install, check=True, capture_output=True, timeout=TIMEOUT)
    return python


def _run(python: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PYTHONWARNINGS"] = "ignore"
    env["SMOKE_DIR"] = str(cwd)
    return subprocess.run(
        [str(python), *args], capture_output=True, text=True, timeout=TIMEOUT, cwd=cwd, env=env
    )


# Runs in the fresh environment: a 2-rank smoke run through every installed plugin.
SMOKE = textwrap.dedent(
    """
    import json, sys

    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from hyperfsdp_core import fully_shard
    from hyperfsdp_core.plugin import get_plugin_manager
    from hyperfsdp_core.testing import run_on_ranks


    def step(model, mesh, **kwargs):
        fully_shard(model[0], mesh=mesh, **kwargs)
        fully_shard(model, mesh=mesh, **kwargs)
        model(torch.randn(4, 8)).sum().backward()
        return sorted({str(type(p.grad).__name__) for p in model.parameters()})


    def fsdp():
        torch.manual_seed(0)
        return step(nn.Sequential(nn.Linear(8, 7), nn.ReLU(), nn.Linear(7, 3)), None)


    def hsdp():
        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
        torch.manual_seed(0)
        return step(nn.Sequential(nn.Linear(8, 7), nn.ReLU(), nn.Linear(7, 3)), mesh)


    def offload():
        from hyperfsdp_core import CPUOffloadPolicy

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 7), nn.ReLU(), nn.Linear(7, 3))
        kinds = step(model, None, offload_policy=CPUOffloadPolicy())
        assert {p.grad.to_local().device.type for p in model.parameters()} == {"cpu"}
        return kinds


    def shm():
        torch.manual_seed(0)
        return step(nn.Sequential(nn.Linear(8, 7), nn.ReLU(), nn.Linear(7, 3)), None)


    def qcomm():
        import hyperfsdp_qcomm

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 7), nn.ReLU(), nn.Linear(7, 3))
        hyperfsdp_qcomm.enable(model, min_numel=0)
        return step(model, None)


    def tp():
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 3))
        # row-wise bias: replicated over tp, so the root-tail TP all-reduce runs too
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        return step(model, mesh["dp"])


    def dcp():
        import os

        import torch.distributed as dist
        from hyperfsdp_dcp import CheckpointManager

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 7), nn.ReLU(), nn.Linear(7, 3))
        kinds = step(model, None)
        folder = os.path.join(os.environ["SMOKE_DIR"], "ckpt")
        saved = {n: p.full_tensor() for n, p in model.named_parameters()}
        with CheckpointManager(folder, model=model) as manager:
            manager.save(1)
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        with CheckpointManager(folder, model=model) as manager:
            manager.resume()
        for n, p in model.named_parameters():
            assert torch.equal(p.full_tensor(), saved[n]), n
        dist.barrier()
        return kinds


    def rank_main():
        pm = get_plugin_manager()
        names = [n for n, _ in pm.list_name_plugin() if not n.startswith("hyperfsdp.")]
        runs = {"core": fsdp()}
        for name in names:
            runs[name] = globals()[name]()
        return names, runs


    if __name__ == "__main__":
        results = run_on_ranks(2, rank_main, timeout=120)
        print(json.dumps(results[0]))
    """
)


def _check_install(tmp: Path, wheels: Path, extras: list[str], requested: str = "") -> Path:
    """Install ``hyperfsdp[requested]`` (default: the extras) from the wheels into a fresh
    environment: the package comes from there, and the plugins it lists are the extras'.
    Returns the environment's interpreter and leaves a working folder ``tmp/work``."""
    python = _fresh_env(tmp, wheels, f"hyperfsdp[{requested or ','.join(extras)}]")
    work = tmp / "work"  # outside the checkout: nothing importable by accident
    work.mkdir()
    where = _run(python, "-c", "import hyperfsdp_core; print(hyperfsdp_core.__file__)", cwd=work)
    assert str(tmp) in where.stdout, where.stdout + where.stderr  # the wheel, not the checkout

    plugins = _run(python, "-m", "hyperfsdp_core", "plugins", cwd=work)
    assert plugins.returncode == 0, plugins.stderr
    listed = re.findall(r"^\s+(\S+)\s+hyperfsdp-\S+\s", plugins.stdout, re.MULTILINE)
    assert sorted(listed) == sorted(extras), plugins.stdout
    for extra in extras:
        assert re.search(rf"^\s+{extra}\s+{EXTRAS[extra]}\s", plugins.stdout, re.MULTILINE)
    return python


def _available(wheels: Path, extras: tuple[str, ...]) -> list[str]:
    names = {p.name.split("-")[0].replace("_", "-") for p in wheels.glob("*.whl")}
    return [e for e in extras if EXTRAS[e] in names]


def test_tp_hsdp_extras_install_from_wheels(wheels, tmp_path):
    """``pip install hyperfsdp[tp,hsdp]`` installs those two plugins and no other (they
    train in the smoke run of the ``all`` extra, below)."""
    extras = _available(wheels, ("tp", "hsdp"))
    assert extras == ["tp", "hsdp"]
    _check_install(tmp_path, wheels, extras)


def test_wheels_are_built_for_the_core_and_every_plugin(wheels):
    built = sorted(p.name.split("-")[0] for p in wheels.glob("*.whl"))
    plugins = sorted(
        "hyperfsdp_" + p.parent.name for p in (ROOT / "plugins").glob("*/pyproject.toml")
    )
    assert built == sorted(["hyperfsdp", *plugins])
    (core,) = wheels.glob("hyperfsdp-*.whl")
    files = zipfile.ZipFile(core).namelist()
    for module in ("cli/__init__", "comm/__init__", "engine/state", "plugin/__init__", "api"):
        assert f"hyperfsdp_core/{module}.py" in files  # every layer's package ships
    assert not [f for f in files if "bench" in f]  # the suite is not in the core's wheel


def test_all_extra_installs_every_plugin_from_wheels(wheels, tmp_path):
    """``hyperfsdp[all]``: every plugin, each through a 2-rank smoke run; the demo and the
    ``hyperfsdp`` command work, without ``bench`` (a distribution of its own)."""
    extras = ["dcp", "hsdp", "offload", "qcomm", "shm", "tp"]
    assert _available(wheels, tuple(extras)) == extras
    python = _check_install(tmp_path, wheels, extras, requested="all")
    work = tmp_path / "work"

    (work / "smoke.py").write_text(SMOKE)
    proc = _run(python, "smoke.py", cwd=work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    names, runs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(names) == sorted(extras)
    assert sorted(runs) == sorted(["core", *extras])
    assert all(kinds == ["DTensor"] for kinds in runs.values()), runs

    out = _run(python, "-m", "hyperfsdp_core", "demo", "--world-size", "2", "--steps", "2",
               "--layers", "1", "--dim", "16", cwd=work)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "parity with the single-process reference: OK" in out.stdout

    helptext = _run(python, "-m", "hyperfsdp_core", "--help", cwd=work).stdout
    assert " bench " not in helptext  # the benchmark suite is a distribution of its own
    bench = _run(python, "-m", "hyperfsdp_core", "bench", cwd=work)
    assert bench.returncode == 2 and "invalid choice: 'bench'" in bench.stderr


def test_bench_wheel_adds_the_bench_command(wheels, bench_wheel, tmp_path):
    """Installed from its own wheel, hyperfsdp-bench brings its plugins (hsdp, tp, offload)
    and the ``hyperfsdp bench`` command; ``HYPERFSDP_PLUGINS_DISABLE=bench`` takes it away."""
    (wheel,) = bench_wheel.glob("*.whl")
    files = zipfile.ZipFile(wheel).namelist()
    assert "hyperfsdp_bench/plugin.py" in files and "hyperfsdp_bench/suite.py" in files
    assert not [f for f in files if f.startswith("hyperfsdp_core/")]
    python = _fresh_env(tmp_path, wheels, str(wheel))
    work = tmp_path / "work"
    work.mkdir()
    plugins = _run(python, "-m", "hyperfsdp_core", "plugins", cwd=work)
    assert plugins.returncode == 0, plugins.stderr
    for name, dist in [
        ("bench", "hyperfsdp-bench"),
        *((e, EXTRAS[e]) for e in ("hsdp", "tp", "offload", "shm")),
    ]:
        assert re.search(rf"^\s+{name}\s+{dist}\s", plugins.stdout, re.MULTILINE), plugins.stdout
    listing = _run(python, "-m", "hyperfsdp_core", "bench", "--list", "--config", "tp", cwd=work)
    assert listing.returncode == 0, listing.stderr
    assert listing.stdout == (
        "tp w4 L8                 impls: hyperfsdp, fsdp2, floor\n"
        "tp w2 L8                 impls: hyperfsdp, fsdp2, floor\n"
    )
    helptext = _run(python, "-m", "hyperfsdp_core", "bench", "--help", cwd=work).stdout
    assert "./hyperfsdp-bench-results/latest.json" in helptext  # not inside site-packages

    env_python = [str(python), "-m", "hyperfsdp_core", "bench", "--list"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["HYPERFSDP_PLUGINS_DISABLE"] = "bench"
    off = subprocess.run(env_python, capture_output=True, text=True, cwd=work, env=env,
                         timeout=TIMEOUT)  # fmt: skip
    assert off.returncode == 2 and "invalid choice: 'bench'" in off.stderr
