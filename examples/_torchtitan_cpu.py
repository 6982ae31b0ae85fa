"""What the torchtitan examples share: importing torchtitan 0.3.0 on a CPU-only torch, its
Llama3 debugmodel set up for CPU, and a run with hyperfsdp against one with FSDP2.

Used by ``examples/torchtitan_tp.py`` and ``examples/torchtitan_pp.py`` (and
``plugins/qcomm/examples/torchtitan_qcomm.py``); not part of hyperfsdp. Call
:func:`stub_triton_kernels` before anything imports torchtitan.
"""

from __future__ import annotations

import sys
import types

#: the one torchtitan module that imports triton at import time
TRITON_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"


def stub_triton_kernels() -> None:
    """Stand a placeholder in for torchtitan's expert-parallel triton kernels, before
    torchtitan is imported.

    ``torchtitan.models.common`` imports the MoE token dispatcher, which imports these
    kernels, and with them triton, which a CPU-only torch lacks. The dense Llama path never
    calls them: any attribute of the placeholder is a function that raises
    ``NotImplementedError`` when called. A real module already imported is left alone.
    """

    class _Missing(types.ModuleType):
        def __getattr__(self, attr):
            if attr.startswith("__"):
                raise AttributeError(attr)

            def missing(*args, **kwargs):
                raise NotImplementedError(f"{TRITON_KERNELS}.{attr} needs triton")

            return missing

    sys.modules.setdefault(TRITON_KERNELS, _Missing(TRITON_KERNELS))


def use_fully_shard(fully_shard_fn) -> None:
    """Make torchtitan shard with ``fully_shard_fn`` (what ``apply_fsdp_to_decoder`` calls),
    on the CPU (torchtitan falls back to "cuda" without an accelerator)."""
    import torchtitan.distributed.fsdp as titan_fsdp
    import torchtitan.distributed.parallel_dims as titan_dims

    titan_dims.device_type = "cpu"
    titan_fsdp.fully_shard = fully_shard_fn


def debugmodel_config(layers: int, enable_sp: bool):
    """The Llama3 ``debugmodel``'s config, its first ``layers`` layers, with SDPA attention
    (FlexAttention has no backward on CPU; SDPA, causal with one document per row, is what
    torchtitan's maskless tests use) and torchtitan's sharding config, as
    ``Llama3Model.Config.update_from_config`` sets it for a dense model (that method imports
    torchtitan.trainer, and with it the data stack: torchdata, datasets, tokenizers)."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    config = model_registry("debugmodel").model
    config.layers = config.layers[:layers]
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    set_llama3_sharding_config(config, enable_sp=enable_sp)
    return config


def materialize(module) -> None:
    """Allocate a parallelized meta-device model (part) on the CPU and initialize it from
    seed 0, as torchtitan does; FSDP2 then reduces with SUM. torchtitan turns FSDP's gradient
    division off (it divides the loss by the global token count), which makes FSDP2 use
    PREMUL_SUM, which gloo lacks: SUM (and a division by 1.0) instead. hyperfsdp always
    reduces with SUM."""
    import torch

    module.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        module.init_weights(buffer_device=torch.device("cpu"))
    for sub in module.modules():
        if hasattr(sub, "set_force_sum_reduction_for_comms"):
            sub.set_force_sum_reduction_for_comms(True)
    module.train()


def compare_with_fsdp2(train, args, title: str | None = None) -> None:
    """On gloo: ``train(args, fully_shard_fn)`` with hyperfsdp's ``fully_shard``, then with
    FSDP2's; rank 0 prints both loss series; fails if they differ beyond fp32 tolerance."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from hyperfsdp_core import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    ours = train(args, fully_shard)
    theirs = train(args, torch_fully_shard)
    if dist.get_rank() == 0:
        if title:
            print(title)
        print("step  hyperfsdp            FSDP2")
        for step, (a, b) in enumerate(zip(ours, theirs)):
            print(f"{step:4d}  {a:.10f}  {b:.10f}")
    dist.destroy_process_group()
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-5, atol=1e-6)
