"""The implementations compared: hyperfsdp, torch FSDP2, DDP and a compute-only floor."""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Callable

import attrs
import torch
from torch import nn

from .model import ModelConfig, build_model
from .names import IMPLS, OFFLOAD_VARIANTS, VARIANTS

#: Opt-in variants (``--impl``), each a main implementation with one change:
#:
#: - ``hyperfsdp-tuned``: hyperfsdp with its CPU communication knobs turned on, to measure
#:   what they buy: reduce-scatters on their own process group (own gloo threads) and two
#:   reduce-scatters in flight before post-backward waits;
#: - ``<impl>-foreach``: ``torch.optim.AdamW(..., foreach=True)`` instead of the default
#:   (on CPU: the per-tensor loop), to measure what the multi-tensor optimizer buys;
#: - ``hyperfsdp-native``: hyperfsdp with gloo's own all-gather and reduce-scatter
#:   (``HYPERFSDP_GLOO_NATIVE_COLLECTIVES=1``), as FSDP2 runs them, instead of the core's
#:   gloo routes and the hyperfsdp-shm plugin's shared memory;
#: - ``hyperfsdp-core``: the core alone, what ``pip install hyperfsdp`` gives
#:   (``HYPERFSDP_SHM=0``: the hyperfsdp-shm plugin supplies no transport): the core's gloo
#:   routes without gloo's full-size buffers.
#:
#: The ``offload`` configuration adds its own: ``hyperfsdp-no-offload`` and
#: ``fsdp2-no-offload`` (the same without offload) and ``fsdp2-unpinned`` (FSDP2's
#: ``CPUOffloadPolicy(pin_memory=False)``, which runs without an accelerator where the
#: default ``CPUOffloadPolicy()`` refuses).
#: (the names: ``names.VARIANTS``, ``names.OFFLOAD_VARIANTS``)
ALL_IMPLS = IMPLS + VARIANTS + OFFLOAD_VARIANTS
#: Main implementations that run under torch.distributed (the floor runs one independent
#: process per rank, except in tensor-parallel cases: see ``needs_process_group``).
_DISTRIBUTED_BASES = frozenset({"hyperfsdp", "fsdp2", "ddp"})
_SUFFIXES = ("-tuned", "-native", "-core", "-foreach", "-no-offload", "-unpinned")


def parse_impl(impl: str) -> tuple[str, str]:
    """``"fsdp2-foreach"`` -> ``("fsdp2", "foreach")``; a main implementation has no variant."""
    for suffix in _SUFFIXES:
        if impl.endswith(suffix) and impl[: -len(suffix)] in IMPLS:
            return impl[: -len(suffix)], suffix[1:]
    if impl not in IMPLS:
        raise ValueError(f"unknown implementation {impl!r}; choose from {', '.join(ALL_IMPLS)}")
    return impl, ""


def is_distributed(impl: str) -> bool:
    return parse_impl(impl)[0] in _DISTRIBUTED_BASES


def needs_process_group(impl: str, spec: CaseSpec) -> bool:
    """Whether ``impl``'s rank processes join one process group for ``spec``: every
    distributed implementation, and the floor of a tensor-parallel case (its "tp" collectives)."""
    return is_distributed(impl) or spec.tp is not None


def family(impl: str) -> str:
    """The suffix shared by an implementation and its references: ``"-foreach"`` or ``""``."""
    return "-foreach" if parse_impl(impl)[1] == "foreach" else ""


class Refused(RuntimeError):
    """An implementation declines a configuration (reported as such, not as a failure)."""


def _tune_hyperfsdp(model: nn.Module) -> list[str]:
    """Apply the knobs this engine version has; returns the ones applied."""
    applied = []
    for name, args in (
        ("set_separate_reduce_scatter_group", (True,)),
        ("set_reduce_scatter_max_input_buffers", (2,)),
    ):
        setter = getattr(model, name, None)
        if setter is not None:
            setter(*args)
            applied.append(name)
    return applied


@attrs.frozen
class CaseSpec:
    """Everything a rank needs to build one implementation of one benchmark case."""

    model: ModelConfig
    precision: str = "fp32"  # "fp32" or "bf16" (bf16 compute, fp32 reduce)
    reshard_after_forward: bool | None = None  # None: the FSDP default
    hsdp: tuple[int, int] | None = None  # (replicate, shard): a 2-D HSDP mesh for both FSDPs
    #: tensor-parallel degree: a (world / tp, tp) ("dp", "tp") mesh, the model parallelized
    #: on "tp" (Colwise/Rowwise with sequence parallelism) before FSDP over "dp"
    tp: int | None = None
    #: the tp mesh dimension's c10d backend (``backend_override``); None: the default (gloo)
    tp_backend: str | None = None
    offload: bool = False  # CPUOffloadPolicy() for both FSDPs (see OFFLOAD_VARIANTS)
    seed: int = 1234
    lr: float = 1e-3


@attrs.define
class Built:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    n_units: int = 0
    #: the module whose parameters are the training state (live bytes); None: ``model``
    state_model: nn.Module | None = None


def _autocast_bf16() -> contextlib.AbstractContextManager:
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _bf16_compute_copy(model: nn.Module) -> nn.Module:
    """The floor of the bf16 cases: what both FSDPs compute under
    ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, without communication.

    Returns a bf16 copy of ``model`` that runs forward and backward. ``model``'s fp32
    parameters stay the training state (the optimizer's): they are cast into the copy
    before every forward, and each copy's gradient is cast back to fp32 into its
    parameter's ``.grad`` as soon as it is accumulated (the copy keeps none).
    """
    compute = copy.deepcopy(model).to(torch.bfloat16)
    pairs = list(zip(compute.parameters(), model.parameters(), strict=True))

    def cast_in(module, args) -> None:
        with torch.no_grad():
            for low, full in pairs:
                low.copy_(full)

    def cast_out(full: nn.Parameter, low: nn.Parameter) -> None:
        grad = low.grad.float()
        full.grad = grad if full.grad is None else full.grad.add_(grad)
        low.grad = None

    compute.register_forward_pre_hook(cast_in)
    for low, full in pairs:
        low.register_post_accumulate_grad_hook(lambda p, full=full: cast_out(full, p))
    return compute


def _tensor_parallel(model: nn.Module, spec: CaseSpec):
    """Parallelize ``model`` on the "tp" dimension of a (world / tp, tp) ("dp", "tp") mesh
    (Colwise/Rowwise with sequence parallelism); returns the mesh's "dp" dimension."""
    import torch.distributed as dist
    from hyperfsdp_tp.testing import parallelize
    from torch.distributed.device_mesh import init_device_mesh

    shape = (dist.get_world_size() // spec.tp, spec.tp)
    override = None
    if spec.tp_backend is not None:
        from hyperfsdp_shm import register_shm_backend

        override = {"tp": spec.tp_backend}
        register_shm_backend()
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"), backend_override=override)
    parallelize(model, mesh["tp"], "sp")
    return mesh["dp"]


def _shard(model: nn.Module, fully_shard, mp_policy_cls, spec: CaseSpec, offload=None) -> int:
    kwargs = {}
    if offload is not None:
        kwargs["offload_policy"] = offload
    if spec.precision == "bf16":
        kwargs["mp_policy"] = mp_policy_cls(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if spec.reshard_after_forward is not None:
        kwargs["reshard_after_forward"] = spec.reshard_after_forward
    if spec.hsdp is not None:
        from torch.distributed.device_mesh import init_device_mesh

        kwargs["mesh"] = init_device_mesh("cpu", spec.hsdp, mesh_dim_names=("replicate", "shard"))
    if spec.tp is not None:
        kwargs["mesh"] = _tensor_parallel(model, spec)
    for layer in model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return len(model.layers) + 1


def data_rank(spec: CaseSpec, rank: int) -> int:
    """Which local batch a rank trains on: tensor-parallel ranks of a data-parallel rank share one."""
    return rank // spec.tp if spec.tp is not None else rank


def build(impl: str, spec: CaseSpec) -> Built:
    base, variant = parse_impl(impl)
    model = build_model(spec.model, spec.seed)
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    n_units = 0
    offload = spec.offload and variant != "no-offload"
    if base == "hyperfsdp":
        from hyperfsdp_core import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        # switches read at the root's lazy init (this process runs one impl)
        if variant == "native":
            os.environ["HYPERFSDP_GLOO_NATIVE_COLLECTIVES"] = "1"
        elif variant == "core":
            os.environ["HYPERFSDP_SHM"] = "0"

        policy = CPUOffloadPolicy() if offload else None
        n_units = _shard(model, fully_shard, MixedPrecisionPolicy, spec, policy)
        if variant == "tuned" and not _tune_hyperfsdp(model):
            raise RuntimeError("hyperfsdp-tuned: this engine version has none of the knobs")
    elif base == "fsdp2":
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        policy = None
        if offload:
            policy = CPUOffloadPolicy(pin_memory=variant != "unpinned")
        try:
            n_units = _shard(model, fully_shard, MixedPrecisionPolicy, spec, policy)
        except RuntimeError as exc:
            if policy is None or policy.pin_memory is False or torch.accelerator.is_available():
                raise
            raise Refused(
                "FSDP2's CPUOffloadPolicy() refuses to run without an accelerator (it pins "
                f"the sharded parameters): {exc}"
            ) from exc
    elif base == "floor" and spec.tp is not None:
        # The tensor-parallel floor: the same TP model without FSDP. Each data-parallel
        # replica trains its local batch on its own; only the "tp" collectives run.
        _tensor_parallel(model, spec)
    elif base == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
        if spec.precision == "bf16":  # bf16 compute, gradients (and their all-reduce) in fp32
            autocast = _autocast_bf16
    foreach = True if variant == "foreach" else None  # None: torch's default (CPU: the loop)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.1, foreach=foreach)
    if base == "floor" and spec.precision == "bf16":  # the FSDPs' mixed precision, no comms
        return Built(_bf16_compute_copy(model), optimizer, autocast, n_units, state_model=model)
    return Built(model, optimizer, autocast, n_units)


def ddp_comm(model: nn.Module) -> dict[str, dict[str, int]]:
    """All-reduces per step and their bytes for DDP's C++ reducer (invisible to Python wrappers).

    Read from DDP's logging data: the buckets as rebuilt after the first iteration.
    """
    data = model._get_ddp_logging_data()  # type: ignore[operator]
    text = str(data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or "")
    sizes = [int(s) for s in text.split(",") if s.strip()]
    count = int(data.get("num_buckets_reduced") or len(sizes))
    return {"calls": {"all_reduce": count}, "bytes": {"all_reduce": sum(sizes)}}
