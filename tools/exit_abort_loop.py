"""Launch a small gloo script many times and count the launches where a rank died by SIGABRT.

The abort at exit of issue 30 item 7 ("terminate called without an active exception", see
docs/design.md, "An abort at exit") is timing-dependent: it needs the main thread to keep the
GIL from the moment a gloo collective completes until the interpreter finalizes. The scripts:

* ``funcol``: torch's functional all-gather (``all_gather_single(...).wait()``) 20 times,
  ``destroy_process_group()``; no FSDP.
* ``fsdp2``: torch's FSDP2 on four ``Linear`` layers, 5 AdamW steps, an eval forward, every
  parameter's ``full_tensor()``, ``destroy_process_group()``.
* ``hyperfsdp``: the same with ``hyperfsdp_core.fully_shard``.
* ``det``: deterministic: an async gloo all-gather whose Python handle is dropped at once,
  then a busy loop that keeps the GIL (switch interval 1000 s) until the work has completed,
  then return; aborts nearly every launch without the drain.

``--drain`` imports ``hyperfsdp_core`` first (which registers its exit drain) in the scripts
that would not; ``--no-drain`` unregisters it in the ``hyperfsdp`` script (the code before
the fix). Ranks run as plain processes (no torchrun), one launch at a time, ``nice 19``; they
meet through a fresh file store per launch, not a TCP port that another process on the machine
could take between choosing and binding it.

    python tools/exit_abort_loop.py --script hyperfsdp --launches 200
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

_PRELUDE = """
import os, sys, time, atexit, torch, torch.distributed as dist
if {drain}:
    import hyperfsdp_core
if {no_drain}:
    import hyperfsdp_core.comm.exit as _e
    atexit.unregister(_e.drain_native_threads)
dist.init_process_group(
    "gloo",
    init_method="file://" + os.environ["EXIT_LOOP_STORE"],
    rank=int(os.environ["RANK"]),
    world_size=int(os.environ["WORLD_SIZE"]),
)
"""

_SCRIPTS = {
    "funcol": """
import torch.distributed._functional_collectives as funcol
t = torch.ones(64, 64)
for _ in range(20):
    funcol.all_gather_single(t, 0, dist.group.WORLD).wait()
dist.destroy_process_group()
""",
    "fsdp2": """
from torch import nn
from torch.distributed.fsdp import fully_shard
torch.manual_seed(0)
m = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
for layer in m:
    fully_shard(layer)
fully_shard(m)
opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
for _ in range(5):
    m(torch.randn(8, 64)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
with torch.no_grad():
    m(torch.randn(8, 64))
    full = [p.full_tensor() for p in m.parameters()]
dist.destroy_process_group()
""",
    "det": """
dist.barrier()
sys.setswitchinterval(1000.0)
out = torch.empty(2 * dist.get_world_size(), 64)
work = dist.all_gather_into_tensor(out, torch.ones(2, 64), async_op=True)
del work, out
t0 = time.perf_counter()
while time.perf_counter() - t0 < 0.5:
    pass
""",
}
_SCRIPTS["hyperfsdp"] = _SCRIPTS["fsdp2"].replace(
    "from torch.distributed.fsdp import fully_shard", "from hyperfsdp_core import fully_shard"
)


# Once a rank has failed, the seconds the others get to finish before they are killed (a rank
# left waiting in the rendezvous or a collective would otherwise hold the launch for `timeout`).
_GRACE_AFTER_FAILURE = 10.0


def launch(path: str, store: str, world: int, timeout: float) -> tuple[list[int], list[str]]:
    """Run ``world`` ranks of ``path`` meeting at the file ``store``; their exit codes and output."""
    procs, logs = [], [f"{store}.rank{rank}.log" for rank in range(world)]
    for rank in range(world):
        env = dict(
            os.environ,
            EXIT_LOOP_STORE=store,
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            OMP_NUM_THREADS="1",
        )
        with open(logs[rank], "wb") as log:  # a file, not a pipe that could fill while we poll
            procs.append(
                subprocess.Popen(
                    ["nice", "-n", "19", sys.executable, path],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = [proc.poll() for proc in procs]  # every rank, so none's exit goes unseen
        if None not in codes:
            break
        if any(code not in (None, 0) for code in codes):
            deadline = min(deadline, time.monotonic() + _GRACE_AFTER_FAILURE)
        time.sleep(0.05)
    outs = []
    for proc, log in zip(procs, logs):
        killed = proc.poll() is None
        if killed:
            proc.kill()
            proc.wait()
        with open(log, errors="replace") as f:
            outs.append(f.read() + ("\n[killed: still running]" if killed else ""))
    return [proc.returncode for proc in procs], outs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--script", choices=sorted(_SCRIPTS), default="hyperfsdp")
    parser.add_argument("--launches", type=int, default=20)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per launch")
    drain = parser.add_mutually_exclusive_group()
    drain.add_argument("--drain", action="store_true", help="import hyperfsdp_core first")
    drain.add_argument("--no-drain", action="store_true", help="unregister hyperfsdp's drain")
    args = parser.parse_args(argv)
    source = _PRELUDE.format(drain=args.drain, no_drain=args.no_drain) + _SCRIPTS[args.script]
    aborted = failed = 0
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"exit_{args.script}.py")
        with open(path, "w") as f:
            f.write(source)
        for i in range(args.launches):
            store = os.path.join(tmp, f"store{i}")
            rcs, outs = launch(path, store, args.world, args.timeout)
            if any(rc == -6 for rc in rcs):
                aborted += 1
                print(f"launch {i}: SIGABRT (exit codes {rcs})", flush=True)
            elif any(rc != 0 for rc in rcs):
                failed += 1
                bad = next(r for r, rc in enumerate(rcs) if rc != 0)
                print(f"launch {i}: exit codes {rcs}; rank {bad}:\n{outs[bad][-2000:]}", flush=True)
    mode = "drain" if args.drain else "no drain" if args.no_drain else "as is"
    print(
        f"{args.script} ({mode}), world {args.world}: {aborted} of {args.launches} launches "
        f"aborted, {failed} failed otherwise ({time.monotonic() - start:.0f} s)"
    )
    return 1 if aborted or failed else 0


if __name__ == "__main__":
    sys.exit(main())
