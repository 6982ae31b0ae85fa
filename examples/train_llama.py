"""Train a Llama-like model with hyperfsdp under torchrun: the way a user's script does it.

    torchrun --nproc-per-node 4 examples/train_llama.py --steps 20
    torchrun --nproc-per-node 4 examples/train_llama.py --hsdp 2 --bf16 --compile
    torchrun --nproc-per-node 4 examples/train_llama.py --tp 2 --ckpt /tmp/ckpt --every 5
    torchrun --nproc-per-node 4 examples/train_llama.py --tp 2 --shm  # TP over shared memory
    torchrun --nproc-per-node 2 examples/train_llama.py --ckpt /tmp/ckpt --steps 30  # resumes

Every block is a unit, then the root (embedding, final norm, head), as torchtitan does.
Options compose: tensor parallelism over ``--tp`` ranks (needs hyperfsdp[tp]), HSDP with
``--hsdp R`` replicas (hyperfsdp[hsdp]), bf16 compute, ``torch.compile``'d blocks,
gradient accumulation over ``--micro`` micro-batches, CPU offload (hyperfsdp[offload]),
frozen embeddings, a tied head, evaluation every ``--eval-every`` steps, checkpoints every
``--every`` steps with resume (hyperfsdp[dcp]). Synthetic data: batch ``step`` is the same
global batch at any world size, so a run resumed at another world size continues the same
curve. Runs on CPU (gloo) or on GPUs (NCCL) with the same code.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from hyperfsdp_core import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=257, help="odd on purpose: uneven shards")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--micro", type=int, default=1, help="micro-batches per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--hsdp", type=int, default=1, help="replicas (HSDP); 1 = plain FSDP")
    p.add_argument("--bf16", action="store_true", help="bf16 compute, fp32 reduce")
    p.add_argument("--compile", action="store_true", help="torch.compile each block")
    p.add_argument("--offload", action="store_true", help="CPUOffloadPolicy")
    p.add_argument("--freeze-embeddings", action="store_true")
    p.add_argument("--tied", action="store_true", help="tie the head to the embedding")
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--ckpt", help="checkpoint directory (resumes from the newest)")
    p.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    p.add_argument("--loss-file", help="rank 0 appends 'step loss' lines here")
    p.add_argument(
        "--shm",
        action="store_true",
        help="CPU: every process group on the hyperfsdp_shm backend of the hyperfsdp-shm "
        "plugin (all-gathers and reduce-scatters through shared memory, the tensor-parallel "
        "ones included)",
    )
    return p.parse_args(argv)


def batch(args, seed: int, rows: int) -> torch.Tensor:
    """Learnable synthetic sequences: each token follows from the previous one (x -> 5x+1
    mod vocab), from a random start; the same for a seed at any world size."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.empty(rows, args.seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, args.vocab, (rows,), generator=g)
    for t in range(args.seq):
        tokens[:, t + 1] = (5 * tokens[:, t] + 1) % args.vocab
    return tokens


def build(args, device):
    if args.tp > 1:
        from hyperfsdp_tp.testing import Transformer
    else:
        from hyperfsdp_core.testing.reference import Transformer
    torch.manual_seed(0)
    with torch.device("meta"):
        kwargs = {
            "vocab": args.vocab,
            "dim": args.dim,
            "n_layers": args.layers,
            "n_heads": args.heads,
        }
        # an odd hidden size (uneven FSDP shards); TP needs it to divide over the TP ranks
        hidden = 3 * args.dim if args.tp > 1 else 3 * args.dim - 5
        model = Transformer(hidden=hidden, **kwargs)
    if args.tied:
        model.output.weight = model.tok_embeddings.weight
    return model


def main(argv=None) -> int:
    args = parse_args(argv)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if args.shm:  # the hyperfsdp-shm plugin (pip install hyperfsdp[shm])
        from hyperfsdp_shm import register_shm_backend

        backend = register_shm_backend()
    dist.init_process_group(backend)
    world, rank = dist.get_world_size(), dist.get_rank()
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        if backend == "nccl"
        else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dp = world // args.tp
    shard = dp // args.hsdp
    dims, names = [], []
    if args.hsdp > 1:
        dims.append(args.hsdp), names.append("dp_replicate")
    dims.append(shard), names.append("dp_shard")
    if args.tp > 1:
        dims.append(args.tp), names.append("tp")
    mesh = init_device_mesh(device.type, tuple(dims), mesh_dim_names=tuple(names))
    dp_names = tuple(n for n in names if n != "tp")
    dp_mesh = mesh[dp_names] if args.tp > 1 else mesh  # (dp_replicate,) dp_shard

    model = build(args, device)
    if args.tp > 1:
        from hyperfsdp_tp.testing import parallelize

        parallelize(model, mesh["tp"], "sp")
    policy = (
        MixedPrecisionPolicy(torch.bfloat16, torch.float32) if args.bf16 else MixedPrecisionPolicy()
    )
    offload = CPUOffloadPolicy() if args.offload else OffloadPolicy()
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh, mp_policy=policy, offload_policy=offload)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy, offload_policy=offload)
    # materialize on the device (sharded: each rank initializes only its shards)
    model.to_empty(device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(std=0.02)
    if args.freeze_embeddings:
        model.tok_embeddings.weight.requires_grad_(False)
    if args.compile:
        for block in model.layers:
            block.compile(fullgraph=True)
    if rank == 0:
        print(model.sharding_plan())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))

    start = 0
    manager = None
    if args.ckpt:
        from hyperfsdp_dcp import CheckpointManager

        manager = CheckpointManager(
            args.ckpt,
            model=model,
            optimizer=opt,
            stateful={"scheduler": sched},
            every=args.every,
            keep_last=2,
        )
        start = manager.resume()
        if rank == 0 and start:
            print(f"resumed at step {start} (world {world})")

    dp_rank = mesh.get_local_rank("dp_shard") + (
        mesh.get_local_rank("dp_replicate") * shard if args.hsdp > 1 else 0
    )
    per_rank = args.global_batch // dp
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        total = 0.0
        for m in range(args.micro):
            tokens = batch(args, 1000 * step + m, args.global_batch)
            local = tokens[dp_rank * per_rank : (dp_rank + 1) * per_rank].to(device)
            x, y = local[:, :-1], local[:, 1:]
            model.set_requires_gradient_sync(m == args.micro - 1)
            logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()) / args.micro
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        dist.all_reduce(total)
        total = float(total) / world  # every rank's (tp ranks: equal) mean of the global batch
        if rank == 0:
            print(
                f"step {step + 1:4d}  loss {total:.6f}  {time.perf_counter() - t0:.2f}s", flush=True
            )
            if args.loss_file:
                with open(args.loss_file, "a") as f:
                    f.write(f"{step + 1} {total:.8f}\n")
        if args.eval_every and (step + 1) % args.eval_every == 0:
            model.eval()
            with torch.no_grad():
                tokens = batch(args, -1 - step, per_rank).to(device)
                eval_loss = F.cross_entropy(
                    model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten()
                )
            model.train()
            if rank == 0:
                print(f"      eval loss {float(eval_loss):.6f}", flush=True)
        if manager is not None:
            manager.maybe_save(step + 1)
    if manager is not None:
        manager.close()
    # every rank done communicating before any tears its groups down (gloo can abort at
    # exit when a peer's connection closes under a running worker thread)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
