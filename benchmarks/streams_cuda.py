"""Stream ordering on a CUDA machine: what ``set_post_optim_event`` lets overlap.

    python benchmarks/streams_cuda.py       # well under a minute on one GPU

Self-contained, like ``offload_cuda.py``: it runs from a checkout with torch, pluggy and
attrs installed. It shards a small transformer over a *simulated* world of 2 on the one
GPU. The process group is torch's fake backend, whose collectives do nothing, so the
all-gather path runs and the figures are about stream order only. Parameters are cast
to bf16 on the all-gather stream (the copy-in), which gives that stream a kernel to see.

For each mode, one step is profiled after two warm-up steps. After the optimizer step,
a spin kernel of about 20 ms is queued on the current stream; that is work queued after
the optimizer, such as logging. Then the next forward runs. The modes:

- ``event``: the event is recorded right after the optimizer step and handed to
  ``set_post_optim_event``. The first copy-in on the all-gather stream should start
  *before* the spin kernel ends.
- ``stream``: no event. The first copy-in should start after the spin kernel ends.

It prints one line per mode and exits non-zero if either expectation fails. The checks
on CPU (``tests/test_streams.py``) establish the order on a simulated device; this
script confirms it on a real one.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPIN_CYCLES = 40_000_000  # about 20 ms at 2 GHz


def _setup():
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.cuda.set_device(0)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)


def _kernels(trace_path: str) -> list[dict]:
    with open(trace_path) as f:
        trace = json.load(f)
    return [
        e
        for e in trace.get("traceEvents", [])
        if e.get("cat") == "kernel" and "stream" in e.get("args", {})
    ]


def run(mode: str) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.profiler import ProfilerActivity, profile

    from hyperfsdp_core import MixedPrecisionPolicy, fully_shard
    from hyperfsdp_core.testing.reference import Transformer

    torch.manual_seed(0)
    model = Transformer(vocab=1024, dim=512, n_layers=4, n_heads=8, hidden=1536).cuda()
    mesh = init_device_mesh("cuda", (2,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, 1024, (4, 129), device="cuda")
    x, y = tokens[:, :-1], tokens[:, 1:]

    def step():
        out = model(x)
        loss = torch.nn.functional.cross_entropy(out.flatten(0, 1).float(), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), f"{mode}.json")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        if mode == "event":
            model.set_post_optim_event(torch.cuda.current_stream().record_event())
        torch.cuda._sleep(SPIN_CYCLES)  # queued after the optimizer step (and the event)
        model(x)  # the forward whose first all-gathers are measured
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    kernels = _kernels(path)
    spin = [k for k in kernels if "spin" in k["name"].lower()]
    if len(spin) != 1:
        return {"mode": mode, "error": f"found {len(spin)} spin kernels"}
    spin = spin[0]
    spin_end = spin["ts"] + spin["dur"]
    current = spin["args"]["stream"]
    side = [k for k in kernels if k["args"]["stream"] != current and k["ts"] >= spin["ts"] - 1]
    if not side:
        return {"mode": mode, "error": "no kernel on another stream after the spin kernel"}
    first = min(side, key=lambda k: k["ts"])
    return {
        "mode": mode,
        "spin_ms": spin["dur"] / 1e3,
        "first_side_kernel": first["name"][:60],
        "starts_before_spin_ends_ms": (spin_end - first["ts"]) / 1e3,
    }


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("streams_cuda.py needs a CUDA device; the CPU checks are tests/test_streams.py")
        return 2
    _setup()
    ok = True
    for mode in ("event", "stream"):
        res = run(mode)
        print(json.dumps(res))
        if "error" in res:
            ok = False
            continue
        early = res["starts_before_spin_ends_ms"] > 0
        expected = mode == "event"
        if early != expected:
            ok = False
            print(
                f"  FAIL: mode {mode}: the first all-gather-stream kernel "
                f"{'started before' if early else 'waited for'} the work queued after "
                "the optimizer"
            )
    print("streams: ok" if ok else "streams: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
