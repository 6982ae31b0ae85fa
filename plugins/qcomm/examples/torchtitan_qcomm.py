"""torchtitan's Llama path (``examples/torchtitan_tp.py``) trained with qcomm on and off.

    .venv/bin/torchrun --nproc-per-node 2 plugins/qcomm/examples/torchtitan_qcomm.py --tp 1 --steps 10
    .venv/bin/torchrun --nproc-per-node 4 plugins/qcomm/examples/torchtitan_qcomm.py --tp 2 --steps 10

Runs ``examples/torchtitan_tp.py``'s ``train`` (torchtitan 0.3.0's mesh construction and
``parallelize_llama`` on the Llama3 ``debugmodel``, random tokens, CPU/gloo) twice from the
same seed: with ``hyperfsdp_core.fully_shard``, then with a ``fully_shard`` that also opts
each unit into qcomm (``--all-gather``, ``--reduce-scatter``, ``--min-numel``). Prints both
loss curves, the relative gap per step, and the bytes qcomm put on the wire
(``hyperfsdp_qcomm.WIRE_BYTES``) per route. Needs torchtitan (see that example's docstring).
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--dp-replicate", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--all-gather", default="int8")
    parser.add_argument("--reduce-scatter", default="int8")
    parser.add_argument("--min-numel", type=int, default=1 << 16)
    args = parser.parse_args()

    from _torchtitan_cpu import stub_triton_kernels

    stub_triton_kernels()
    import hyperfsdp_qcomm
    import torch
    import torch.distributed as dist
    import torchtitan_tp

    from hyperfsdp_core import fully_shard

    def qcomm_fully_shard(module, **kwargs):
        out = fully_shard(module, **kwargs)
        for m in module if isinstance(module, list | tuple) else [module]:
            hyperfsdp_qcomm.enable(
                m,
                all_gather=args.all_gather,
                reduce_scatter=args.reduce_scatter,
                min_numel=args.min_numel,
                recurse=False,
            )
        return out

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    exact = torchtitan_tp.train(args, fully_shard)
    hyperfsdp_qcomm.WIRE_BYTES.clear()
    quant = torchtitan_tp.train(args, qcomm_fully_shard)
    routes = collections.Counter()
    for (_, kind, route), n in hyperfsdp_qcomm.WIRE_BYTES.items():
        routes[kind, route] += n
    if dist.get_rank() == 0:
        print(f"qcomm all_gather={args.all_gather} reduce_scatter={args.reduce_scatter}")
        print("step  fp32 comm     qcomm         gap")
        for step, (a, b) in enumerate(zip(exact, quant)):
            print(f"{step:4d}  {a:.8f}  {b:.8f}  {(b - a) / a:+.4%}")
        print("rank 0 wire bytes per step:")
        for (kind, route), n in sorted(routes.items()):
            print(f"  {kind:15s} {route:6s} {n / args.steps / 1e6:8.3f} MB")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
