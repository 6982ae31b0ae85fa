"""torchtitan 0.3.0's Llama path with tensor parallelism, sharded by hyperfsdp and by FSDP2.

Drives torchtitan's own mesh construction (``ParallelDims.build_mesh``: a 1-D world mesh,
``_unflatten`` into the data-loading and the dense meshes) and its own parallelization
(``parallelize_llama``: ``Module.parallelize`` for tensor and sequence parallelism, then
``apply_fsdp_to_decoder``) on the Llama3 ``debugmodel`` flavor, on CPU with gloo. The run is
done twice from the same seed: once with torchtitan's ``fully_shard`` replaced by
``hyperfsdp_core.fully_shard``, once with torch's own FSDP2. Both train a few AdamW steps on
the same random tokens and print their losses; the script fails if they differ by more than
fp32 tolerance.

    .venv/bin/torchrun --nproc-per-node 4 examples/torchtitan_tp.py --tp 2 --steps 5

``--tp 2`` at world 4 is ``dp_shard 2 x tp 2`` (torchtitan's ``fsdp`` mesh is the
data-parallel mesh, ``tp`` the tensor-parallel one; they come from two different
``_unflatten`` calls of the world mesh). ``--dp-replicate 2`` makes it HSDP + TP. The
``partial_dtensor`` SPMD backend is torchtitan's DTensor-for-TP-only path, the one that
calls ``fully_shard(..., mesh=parallel_dims.get_mesh("fsdp"))``.

Where this differs from torchtitan's ``Trainer`` (which needs its dataset, tokenizer and an
accelerator): random tokens, one document per row; SDPA as the inner attention (FlexAttention
has no backward on CPU); the model's sharding config set directly; AdamW without the
learning-rate schedule; FSDP2 told to reduce with SUM (torchtitan turns FSDP's gradient
division off, which makes FSDP2 use PREMUL_SUM, which gloo lacks; a division by 1.0 either
way).

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
    """torchtitan's model, meshes and parallelization, with ``fully_shard_fn`` as FSDP."""
    import torch
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import parallelize_llama

    use_fully_shard(fully_shard_fn)

    world = int(os.environ["WORLD_SIZE"])
    parallelism = ParallelismConfig(
        data_parallel_replicate_degree=args.dp_replicate,
        data_parallel_shard_degree=-1,
        tensor_parallel_degree=args.tp,
        enable_sequence_parallel=True,
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

    config = debugmodel_config(args.layers, parallelism.enable_sequence_parallel)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = config.build()
    model = parallelize_llama(
        model,
        parallel_dims=dims,
        training=training,
        parallelism=parallelism,
        compile_config=CompileConfig(),
        ac_config=None,
        dump_folder="/tmp",
    )
    materialize(model)
    return model, dims


def train(args, fully_shard_fn) -> list[float]:
    """``args.steps`` AdamW steps as torchtitan's trainer takes them (the loss a sum over this
    rank's tokens divided by the global token count, FSDP's gradient division off, gradient
    clipping at 1.0); the global mean loss of each step."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    model, dims = build(args, fully_shard_fn)
    batch_mesh = dims.get_mesh("batch")
    batch_rank = batch_mesh.get_local_rank() if batch_mesh is not None else 0
    batch_size = batch_mesh.size() if batch_mesh is not None else 1
    # torchtitan's default_adamw(lr=8e-4), without the learning-rate schedule
    opt = torch.optim.AdamW(
        model.parameters(), lr=8e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False
    )
    losses = []
    vocab = 2048
    for step in range(args.steps):
        gen = torch.Generator().manual_seed(1000 + step)
        tokens = torch.randint(0, vocab, (args.batch * batch_size, args.seq + 1), generator=gen)
        local = tokens.chunk(batch_size)[batch_rank]
        inputs, labels = local[:, :-1], local[:, 1:]
        # one document per row, as torchtitan's text dataloader yields them
        positions = torch.arange(args.seq).expand(inputs.shape[0], -1)
        logits = model(inputs, positions=positions)
        global_tokens = labels.numel() * batch_size
        with loss_parallel() if isinstance(logits, DTensor) else contextlib.nullcontext():
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
            loss = loss / global_tokens
            loss.backward()
        if isinstance(loss, DTensor):
            loss = loss.full_tensor()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=False)
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if batch_mesh is not None:
            dist.all_reduce(total, group=batch_mesh.get_group())
        losses.append(total.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dp-replicate", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=6, help="the debugmodel has 6")
    parser.add_argument("--batch", type=int, default=2, help="sequences per data-parallel rank")
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()

    stub_triton_kernels()
    compare_with_fsdp2(train, args)


if __name__ == "__main__":
    main()
