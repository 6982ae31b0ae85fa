"""torchtitan 0.3.0's Llama path with pipeline parallelism, sharded by hyperfsdp and by FSDP2.

Drives torchtitan's own pipeline helper (``torchtitan.distributed.pipeline_parallel.pipeline_llm``:
its stage split of the Llama3 ``debugmodel``, ``PipelineStage`` per model part, and its schedule
built by ``_build_pipeline_schedule`` with ``scale_grads=False``), its mesh construction
(``ParallelDims.build_mesh``) and its parallelization of each model part (``parallelize_llama``,
which calls ``apply_fsdp_to_decoder`` and turns FSDP's gradient division off), on CPU with gloo.
The run is done twice from the same seed: once with torchtitan's ``fully_shard`` replaced by
``hyperfsdp_core.fully_shard``, once with torch's own FSDP2. Both train a few AdamW steps on
the same random tokens and print their losses; the script fails if they differ by more than
fp32 tolerance.

    .venv/bin/torchrun --nproc-per-node 4 examples/torchtitan_pp.py --schedule 1F1B
    .venv/bin/torchrun --nproc-per-node 4 examples/torchtitan_pp.py --schedule Interleaved1F1B

World 4 is ``pp 2 x dp_shard 2`` (``parallelism.pipeline_parallel_degree = 2``); 1F1B puts one
stage on each pipeline rank, Interleaved1F1B two (torchtitan's default for looped schedules).
``--tp 2`` at world 8 adds tensor and sequence parallelism inside each stage
(``pp 2 x dp_shard 2 x tp 2``; the loss under ``loss_parallel``, as torchtitan's train context):

    .venv/bin/torchrun --nproc-per-node 8 examples/torchtitan_pp.py --schedule 1F1B --tp 2 --seq 32

Where this differs from torchtitan's ``Trainer`` (which needs its dataset, tokenizer and an
accelerator): random tokens, one document per row; SDPA as the inner attention (FlexAttention
has no backward on CPU); the model's sharding config set directly; AdamW without the
learning-rate schedule and without gradient clipping; the loss a plain sum of token
cross-entropies over the global token count (what torchtitan's loss computes, without its
chunking); FSDP2 told to reduce with SUM (torchtitan turns FSDP's gradient division off,
which makes FSDP2 use PREMUL_SUM, which gloo lacks; a division by 1.0 either way).

torchtitan is not a dependency of hyperfsdp; to run this, install it next to torch without
touching torch (``pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro
docstring_parser typeguard``). Its expert-parallel module imports triton at import time,
which a CPU-only torch lacks; the script stands in a stub for that one module (unused here;
``examples/_torchtitan_cpu.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import os

from _torchtitan_cpu import (
    compare_with_fsdp2,
    debugmodel_config,
    materialize,
    stub_triton_kernels,
    use_fully_shard,
)


def build(args, fully_shard_fn):
    """torchtitan's model split into pipeline stages, each model part parallelized (FSDP by
    ``fully_shard_fn``); returns the schedule, the model parts and the meshes."""
    import torch
    import torch.nn.functional as F
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.models.llama3 import parallelize_llama

    use_fully_shard(fully_shard_fn)

    world = int(os.environ["WORLD_SIZE"])
    parallelism = ParallelismConfig(
        data_parallel_shard_degree=-1,
        pipeline_parallel_degree=args.pp,
        pipeline_parallel_schedule=args.schedule,
        pipeline_parallel_microbatch_size=1,
        tensor_parallel_degree=args.tp,
        enable_sequence_parallel=args.tp > 1,
        spmd_backend="partial_dtensor",
    )
    training = TrainingConfig(
        local_batch_size=args.batch,
        seq_len=args.seq,
        mixed_precision_param="float32",
        mixed_precision_reduce="float32",
    )
    dims = ParallelDims.from_config(parallelism, world)
    dims.build_mesh()

    config = debugmodel_config(args.layers, args.tp > 1)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = config.build()

    def loss_fn(pred, labels, global_valid_tokens):
        # torchtitan's loss: the sum of token cross-entropies over the global token count
        loss = F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(), reduction="sum")
        return loss / global_valid_tokens, {}

    schedule, parts, has_first, has_last = pipeline_llm(
        model,
        parallel_dims=dims,
        training=training,
        parallelism=parallelism,
        compile_config=CompileConfig(),
        ac_config=None,
        dump_folder="/tmp",
        device=torch.device("cpu"),
        model_config=config,
        parallelize_fn=parallelize_llama,
        loss_fn=loss_fn,
    )
    for part in parts:
        materialize(part)
    return schedule, parts, has_first, has_last, dims


def train(args, fully_shard_fn) -> list[float]:
    """``args.steps`` AdamW steps through torchtitan's pipeline schedule; the global mean
    loss of each step."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    schedule, parts, has_first, has_last, dims = build(args, fully_shard_fn)
    batch_mesh = dims.get_mesh("batch")
    batch_rank = batch_mesh.get_local_rank() if batch_mesh is not None else 0
    batch_size = batch_mesh.size() if batch_mesh is not None else 1
    params = [p for part in parts for p in part.parameters()]
    opt = torch.optim.AdamW(
        params, lr=8e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False
    )
    losses = []
    vocab = 2048
    for step in range(args.steps):
        gen = torch.Generator().manual_seed(1000 + step)
        tokens = torch.randint(0, vocab, (args.batch * batch_size, args.seq + 1), generator=gen)
        local = tokens.chunk(batch_size)[batch_rank]
        inputs, labels = local[:, :-1], local[:, 1:]
        global_tokens = torch.tensor(float(labels.numel() * batch_size))
        mb_losses: list = []
        with loss_parallel() if args.tp > 1 else contextlib.nullcontext():
            schedule.step(
                *((inputs,) if has_first else ()),
                target=labels if has_last else None,
                losses=mb_losses if has_last else None,
                loss_kwargs={"global_valid_tokens": global_tokens},
            )
        opt.step()
        opt.zero_grad()
        # the last stage's ranks hold the losses: summed over the world, the global mean
        if has_last:
            mb_losses = [x.full_tensor() if isinstance(x, DTensor) else x for x in mb_losses]
        total = torch.stack(mb_losses).sum().detach() if has_last else torch.zeros(())
        dist.all_reduce(total)
        total = total / args.tp  # every tensor-parallel rank of the last stage holds it
        losses.append(total.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedule", default="1F1B", help="1F1B, Interleaved1F1B, GPipe, ...")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1, help="2 at world 8: pp 2 x dp 2 x tp 2")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=6, help="the debugmodel has 6")
    parser.add_argument("--batch", type=int, default=4, help="sequences per data-parallel rank")
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()

    stub_triton_kernels()
    dp = int(os.environ["WORLD_SIZE"]) // (args.pp * args.tp)
    compare_with_fsdp2(train, args, f"{args.schedule}, pp {args.pp} x dp {dp} x tp {args.tp}")


if __name__ == "__main__":
    main()
