"""torchtitan 0.3.0's ``Trainer`` with pipeline parallelism, sharded by hyperfsdp and by FSDP2.

Runs torchtitan's own ``torchtitan.trainer.Trainer`` (its ``train()`` loop: dataloader, microbatch
split, ``pipeline_llm`` and its schedule, ``parallelize_llama``, the chunked cross-entropy loss,
gradient clipping across the pipeline, AdamW with the warmup/decay schedule, metrics) on the
Llama3 ``debugmodel`` with ``parallelism.pipeline_parallel_degree = 2``, on CPU with gloo. The
run is done twice with the same config and seed: once with torchtitan's ``fully_shard`` replaced
by ``hyperfsdp_core.fully_shard``, once with torch's own FSDP2. Both print the loss and gradient
norm the Trainer logs at each step; the script fails if they differ beyond fp32 tolerance.

    .venv/bin/torchrun --nproc-per-node 4 examples/torchtitan_trainer_pp.py --schedule 1F1B
    .venv/bin/torchrun --nproc-per-node 4 examples/torchtitan_trainer_pp.py --schedule Interleaved1F1B

World 4 is ``pp 2 x dp_shard 2``; 1F1B puts one stage on each pipeline rank, Interleaved1F1B
two. Nothing of torchtitan's source is changed; what this script sets from outside:

- the device: torchtitan picks ``cuda`` when no accelerator is found; ``torchtitan.tools.utils``'
  ``device_type`` is set to ``cpu`` and its ``device_module`` to a small stand-in for
  ``torch.cpu`` with the few memory queries torchtitan's metrics ask for (no statistics on CPU),
  before the rest of torchtitan imports them. With ``cpu``, torchtitan's own
  ``init_distributed`` chooses gloo.
- the data and tokenizer, through the Trainer's pluggable components: torchtitan's text loader
  needs ``datasets`` and its tokenizer ``tokenizers``. Here a byte-level tokenizer and a small
  JSON-lines text corpus written to a temporary folder, packed into ``seq_len`` windows the way
  torchtitan's ``HuggingFaceTextDataset`` does (BOS/EOS per document, labels shifted within a
  document, per-document positions), each data-parallel rank taking every other document,
  batched by torchtitan's ``ParallelAwareDataloader``. ``tokenizers`` is imported by
  ``torchtitan.components.tokenizer`` at import time; where it is missing, a placeholder stands
  in for it (the byte tokenizer never calls it).
- SDPA as the inner attention (FlexAttention has no backward on CPU), activation checkpointing
  and CUDA graphs off, the for-loop AdamW (the fused one is CUDA's).
- two calls into torch that torchtitan 0.3.0's Trainer makes with an API newer than torch 2.13:
  the schedule's ``step(arg_mbs=, kwarg_mbs=, target_mbs=)`` (microbatches already split; torch
  2.13's ``step`` takes the whole batch, so the microbatches are concatenated and the schedule
  splits them back, ``whole_batch_step``) and ``torch.distributed.set_timeout`` (torch 2.13's
  ``distributed_c10d._set_pg_timeout``). Both are bridged only where torch lacks them.
- FSDP2 told to reduce with SUM after ``parallelize_llama`` (torchtitan turns FSDP's gradient
  division off, which makes FSDP2 use PREMUL_SUM, which gloo lacks; a division by 1.0 either
  way), by wrapping the model spec's ``parallelize_fn``.

torchtitan is not a dependency of hyperfsdp; to run this, install it next to torch without
touching torch (``pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro
docstring_parser typeguard torchdata==0.11.0``). Its expert-parallel module imports triton at
import time, which a CPU-only torch lacks; ``examples/_torchtitan_cpu.py`` stands a stub in.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import json
import os
import random
import sys
import tempfile
import types

from _torchtitan_cpu import stub_triton_kernels


class _CpuDeviceModule(types.ModuleType):
    """``torch.cpu`` plus the memory queries torchtitan's metrics make of a device module;
    CPU keeps no allocator statistics, so they report none."""

    def __init__(self):
        import torch

        super().__init__("cpu_device_module")
        self._cpu = torch.cpu

    def __getattr__(self, name):
        return getattr(self._cpu, name)

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def get_device_name(device=None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device=None):
        return types.SimpleNamespace(
            total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        )

    @staticmethod
    def memory_stats(device=None) -> dict:
        return {}

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass


def prepare_torchtitan_for_cpu() -> None:
    """Before torchtitan is imported: placeholders for triton and (where missing) tokenizers,
    tensorboard and datasets, ``cpu`` as torchtitan's device type, and the one torch function
    the Trainer calls that torch 2.13 names differently."""
    stub_triton_kernels()
    # what torchtitan imports at import time from packages this run never calls
    for package, modules in (
        ("tokenizers", {"tokenizers": ("AddedToken", "Tokenizer")}),
        ("tensorboard", {"torch.utils.tensorboard": ("SummaryWriter",)}),
        ("datasets", {"datasets": ("Dataset", "load_dataset"),
                      "datasets.distributed": ("split_dataset_by_node",)}),
    ):  # fmt: skip
        try:
            importlib.import_module(package)
        except ImportError:
            for module, names in modules.items():
                placeholder = types.ModuleType(module)
                for name in names:
                    setattr(placeholder, name, None)
                sys.modules[module] = placeholder
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    import torchtitan.tools.utils as titan_utils

    if not hasattr(dist, "set_timeout"):
        # the Trainer sets its process groups' timeouts after step 1 with
        # ``torch.distributed.set_timeout`` (distributed/utils.py ``set_pg_timeouts``), newer than
        # torch 2.13, which has the same operation as ``distributed_c10d._set_pg_timeout``
        dist.set_timeout = c10d._set_pg_timeout

    titan_utils.device_type = "cpu"
    titan_utils.device_module = _CpuDeviceModule()


def write_corpus(folder: str, documents: int = 256) -> str:
    """A small deterministic JSON-lines corpus (one ``{"text": ...}`` per line)."""
    rng = random.Random(0)
    words = ["pipeline", "stage", "shard", "gradient", "token", "layer", "rank", "mesh",
             "reduce", "gather", "step", "loss", "weight", "batch", "model", "schedule"]  # fmt: skip
    path = os.path.join(folder, "corpus.jsonl")
    with open(path, "w") as f:
        for _ in range(documents):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(8, 80)))
            f.write(json.dumps({"text": text.capitalize() + "."}) + "\n")
    return path


def trainer_components():
    """The byte-level tokenizer and the local text dataloader, as torchtitan Configurables."""
    import torch
    from torch.utils.data import IterableDataset
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.tokenizer import BaseTokenizer

    class ByteTokenizer(BaseTokenizer):
        """UTF-8 bytes as token ids 0-255; BOS 256, EOS 257."""

        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            pass

        def __init__(self, config: Config, *, tokenizer_path: str = ""):
            super().__init__()
            self.bos_id, self.eos_id = 256, 257

        def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
            ids = list(text.encode("utf-8"))
            return [self.bos_id] * add_bos + ids + [self.eos_id] * add_eos

        def decode(self, ids: list[int]) -> str:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

        def get_vocab_size(self) -> int:
            return 258

    class TextDataset(IterableDataset):
        """``HuggingFaceTextDataset``'s packing over a local JSON-lines file, one pass."""

        def __init__(self, path, tokenizer, seq_len, dp_rank, dp_world_size):
            self.path, self.tokenizer, self.seq_len = path, tokenizer, seq_len
            self.dp_rank, self.dp_world_size = dp_rank, dp_world_size

        def __iter__(self):
            inputs, labels, positions = [], [], []
            with open(self.path) as f:
                for index, line in enumerate(f):
                    if index % self.dp_world_size != self.dp_rank:
                        continue
                    text = json.loads(line)["text"]
                    tokens = self.tokenizer.encode(text, add_bos=True, add_eos=True)
                    inputs += tokens[:-1]
                    labels += tokens[1:]
                    positions += [p % self.seq_len for p in range(len(tokens) - 1)]
                    while len(inputs) >= self.seq_len:
                        n = self.seq_len
                        window = {"input": torch.LongTensor(inputs[:n]),
                                  "positions": torch.LongTensor(positions[:n])}  # fmt: skip
                        yield window, torch.LongTensor(labels[:n])
                        inputs, labels, positions = inputs[n:], labels[n:], positions[n:]

    class TextDataLoader(ParallelAwareDataloader):
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(ParallelAwareDataloader.Config):
            pass

        def __init__(self, config: Config, *, dp_world_size, dp_rank, tokenizer, seq_len,
                     local_batch_size, snapshot_every_n_steps=None, **kwargs):  # fmt: skip
            dataset = TextDataset(config.dataset_path, tokenizer, seq_len, dp_rank, dp_world_size)
            super().__init__(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size,
                             batch_size=local_batch_size)  # fmt: skip

    return ByteTokenizer, TextDataLoader


def trainer_config(args, corpus: str):
    """The ``debugmodel`` Trainer config (as torchtitan's ``llama3_debugmodel``, the loss,
    optimizer and learning-rate schedule included), set for CPU and pipeline parallelism."""
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import DebugConfig, ParallelismConfig, TrainingConfig
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry
    from torchtitan.trainer import Trainer

    tokenizer_cls, dataloader_cls = trainer_components()
    spec = model_registry("debugmodel")
    spec.model.layers = spec.model.layers[: args.layers]
    for layer in spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    parallelize = spec.parallelize_fn

    def parallelize_with_sum_reduction(model, **kwargs):
        model = parallelize(model, **kwargs)
        for module in model.modules():
            if hasattr(module, "set_force_sum_reduction_for_comms"):
                module.set_force_sum_reduction_for_comms(True)
        return model

    spec = dataclasses.replace(spec, parallelize_fn=parallelize_with_sum_reduction)
    optimizer = default_adamw(lr=8e-4)
    optimizer.implementation = "for-loop"
    return Trainer.Config(
        model_spec=spec,
        hf_assets_path="",
        dump_folder=os.path.dirname(corpus),
        loss=ChunkedLossWrapper.Config(
            loss_fn=CrossEntropyLoss.Config(global_vocab_size=spec.model.vocab_size)
        ),
        tokenizer=tokenizer_cls.Config(),
        dataloader=dataloader_cls.Config(dataset_path=corpus),
        optimizer=optimizer,
        lr_scheduler=LRSchedulersContainer.Config(
            warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0
        ),
        training=TrainingConfig(
            local_batch_size=args.batch,
            seq_len=args.seq,
            steps=args.steps,
            mixed_precision_param="float32",
            disable_cuda_graphs=True,
        ),
        metrics=MetricsProcessor.Config(log_freq=1),
        parallelism=ParallelismConfig(
            pipeline_parallel_degree=2,
            pipeline_parallel_schedule=args.schedule,
            pipeline_parallel_microbatch_size=1,
            spmd_backend="partial_dtensor",  # as examples/torchtitan_pp.py
        ),
        activation_checkpoint=None,
        debug=DebugConfig(seed=0),
    )


def whole_batch_step(step):
    """The schedule's ``step`` as torchtitan 0.3.0's Trainer calls it.

    The Trainer hands the schedule its microbatches already split
    (``step(arg_mbs=, kwarg_mbs=, target_mbs=, ...)``, trainer.py ``pp_forward_backward_step``),
    a keyword API that torch 2.13's schedules lack: their ``step(*args, target=, **kwargs)``
    takes the whole batch and splits it into ``n_microbatches`` along dim 0, and takes unknown
    keywords for model inputs. Concatenated, the microbatches (of equal size) are split back
    into the same microbatches. A torch whose ``step`` takes ``arg_mbs`` is left alone.
    """
    import torch

    if "arg_mbs" in inspect.signature(step).parameters:
        return step

    def step_microbatches(*, arg_mbs=None, kwarg_mbs=None, target_mbs=None, **kwargs):
        args = tuple(torch.cat(parts) for parts in zip(*arg_mbs)) if arg_mbs else ()
        inputs = {key: torch.cat([mb[key] for mb in kwarg_mbs]) for key in kwarg_mbs[0]}
        target = torch.cat(target_mbs) if target_mbs is not None else None
        return step(*args, target=target, **inputs, **kwargs)

    return step_microbatches


def train(args, corpus: str, fully_shard_fn) -> list[tuple[float, float]]:
    """torchtitan's ``Trainer.train()`` with ``fully_shard_fn`` as FSDP; the (loss, grad norm)
    it logs at each step, as the last pipeline stage's ranks see them."""
    import torch
    import torch.distributed as dist
    import torchtitan.distributed.fsdp as titan_fsdp
    from torchtitan.trainer import Trainer

    titan_fsdp.fully_shard = fully_shard_fn  # what apply_fsdp_to_decoder calls
    trainer = Trainer(trainer_config(args, corpus))
    trainer.pp_schedule.step = whole_batch_step(trainer.pp_schedule.step)
    logged: list[tuple[float, float]] = []
    log = trainer.metrics_processor.log

    def record(step, global_avg_loss, global_max_loss, grad_norm, **kwargs):
        logged.append((float(global_avg_loss), float(grad_norm)))
        return log(step, global_avg_loss, global_max_loss, grad_norm, **kwargs)

    trainer.metrics_processor.log = record
    try:
        trainer.train()
    finally:
        trainer.close()
    # only the last stage's ranks hold the loss; every rank gets their (equal) values
    mine = torch.tensor(logged, dtype=torch.float64) * trainer.pp_has_last_stage
    holders = torch.tensor(float(trainer.pp_has_last_stage), dtype=torch.float64)
    dist.all_reduce(mine)
    dist.all_reduce(holders)
    return [tuple(row) for row in (mine / holders).tolist()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedule", default="1F1B", help="1F1B or Interleaved1F1B")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=6, help="the debugmodel has 6")
    parser.add_argument("--batch", type=int, default=4, help="sequences per data-parallel rank")
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()

    prepare_torchtitan_for_cpu()
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torchtitan.distributed import utils as dist_utils

    from hyperfsdp_core import fully_shard

    torch.set_num_threads(1)
    from torchtitan.config.configs import CommConfig

    dist_utils.init_distributed(CommConfig(trace_buf_size=0))  # gloo for the cpu device
    with tempfile.TemporaryDirectory() as folder:
        corpus = write_corpus(folder)
        ours = train(args, corpus, fully_shard)
        theirs = train(args, corpus, torch_fully_shard)
    if dist.get_rank() == 0:
        dp = dist.get_world_size() // 2
        print(f"Trainer, {args.schedule}, pp 2 x dp {dp}")
        print("step  hyperfsdp loss   FSDP2 loss       hyperfsdp norm   FSDP2 norm")
        for step, (a, b) in enumerate(zip(ours, theirs), start=1):
            print(f"{step:4d}  {a[0]:.10f}  {b[0]:.10f}  {a[1]:.10f}  {b[1]:.10f}")
    dist.destroy_process_group()
    assert len(ours) == len(theirs) == args.steps, (ours, theirs)
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
    main()
