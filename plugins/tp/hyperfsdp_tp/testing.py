"""A small Llama-like model and tensor-parallel plans for tests and benchmarks.

``Transformer`` is ``hyperfsdp_core.testing.reference.Transformer`` with separate q/k/v
projections, which infer their local head count from the projection's output, so
column-wise sharding of the projections splits whole heads.
``parallelize`` applies a Colwise/Rowwise plan on a TP mesh, with or without sequence
parallelism (and loss parallelism on the head), the way torchtitan's Llama path does.
Module names (those of the benchmark model too): ``tok_embeddings``, ``layers.<i>.attn.wq``...,
``norm``, ``output``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from hyperfsdp_core.testing import reference
from hyperfsdp_core.testing.reference import full

from .styles import replicate_module

#: ``parallelize`` variants: sequence parallel (norms on sequence shards, loss parallel
#: head), no SP with norms returning local tensors (their gradients come back
#: ``Replicate``), and no SP with norms returning DTensors (``Partial`` gradients).
VARIANTS = ("sp", "no_sp", "no_sp_dtensor")


class Transformer(reference.Transformer):
    """``hyperfsdp_core.testing.reference.Transformer`` with separate q/k/v projections, the
    embedding's default init and random norm weights (not ones)."""

    def __init__(
        self, vocab: int = 32, dim: int = 16, n_layers: int = 2, n_heads: int = 4, hidden: int = 24
    ) -> None:
        super().__init__(
            vocab, dim, n_layers, n_heads, hidden, fused_qkv=False, scaled_embedding=False
        )
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.uniform_(0.5, 1.5)  # so that wrong norm gradients show in the parameters


def parallelize(
    model: nn.Module, tp_mesh: DeviceMesh, variant: str = "sp", *, loss_parallel: bool = False
) -> nn.Module:
    """Apply a Colwise/Rowwise TP plan to ``model`` (see :data:`VARIANTS`).

    ``loss_parallel=True`` (``"sp"`` only) leaves the logits sharded on the vocabulary dim as
    a DTensor, for ``torch.distributed.tensor.parallel.loss_parallel()``.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    sp = variant == "sp"
    seq = Shard(1) if sp else Replicate()
    root_plan: dict = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(
            input_layouts=seq,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    if sp:
        root_plan["norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, root_plan)
    for block in model.layers:
        plan: dict = {
            "attn.wq": ColwiseParallel(),
            "attn.wk": ColwiseParallel(),
            "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=seq),
            "mlp.w1": ColwiseParallel(),
            "mlp.w3": ColwiseParallel(),
            "mlp.w2": RowwiseParallel(output_layouts=seq),
        }
        if sp:
            plan["attn_norm"] = SequenceParallel()
            plan["mlp_norm"] = SequenceParallel()
            plan["attn"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            )
            plan["mlp"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            )
        parallelize_module(block, tp_mesh, plan)
    if not sp:
        local = variant == "no_sp"
        for norm in [*(b.attn_norm for b in model.layers), *(b.mlp_norm for b in model.layers)]:
            replicate_module(norm, tp_mesh, use_local_output=local)
        replicate_module(model.norm, tp_mesh, use_local_output=local)
    return model


# -- a parity driver --------------------------------------------------------------------------


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy over the vocabulary; a DTensor result (loss parallel) is made local."""
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def train_parity(
    models: Sequence[nn.Module],
    ref: nn.Module,
    dp_rank: int,
    dp_size: int,
    *,
    steps: int = 3,
    lr: float = 0.5,
    clip: float = 0.5,
    seq: int = 8,
    vocab: int = 32,
    loss_parallel: bool = False,
    atol: float = 1e-5,
    rtol: float = 1e-4,
) -> dict[str, list]:
    """Train ``models`` (sharded, on this rank's slice of each global batch) and ``ref``
    (unsharded, on the whole batch) in lockstep with SGD and gradient clipping.

    Asserts, every step, that each model's gradient norm before clipping and after it equals
    the reference's, and at the end that every parameter (``full_tensor()``) does. Returns
    per-step losses (each sharded model's averaged over ranks) and norms. SGD keeps
    parameter errors proportional to gradient errors (Adam would hide a scale error).
    """
    from torch.distributed.tensor.parallel import loss_parallel as loss_parallel_ctx

    from hyperfsdp_core.testing.reference import token_batch

    opts = [torch.optim.SGD(m.parameters(), lr=lr) for m in models]
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    out: dict[str, list] = {"losses": [[] for _ in models], "ref_losses": [], "norms": []}
    world = dist.get_world_size()
    for step in range(steps):
        x, y = token_batch(step, 2 * dp_size, seq, vocab)
        lx, ly = x.chunk(dp_size)[dp_rank], y.chunk(dp_size)[dp_rank]
        ref_loss = F.cross_entropy(ref(x).flatten(0, 1), y.flatten())
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip).item()
        ref_post = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]).item()
        out["ref_losses"].append(ref_loss.item())
        norms = []
        for i, (model, opt) in enumerate(zip(models, opts)):
            ctx = loss_parallel_ctx() if loss_parallel else contextlib.nullcontext()
            with ctx:
                loss = lm_loss(model(lx), ly)
                loss.backward()
            norm = full(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)).item()
            post = full(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
            for name, p in model.named_parameters():
                assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements, name
            assert math.isclose(norm, ref_norm, rel_tol=rtol, abs_tol=atol), (
                f"model {i} step {step}: grad norm {norm} != reference {ref_norm}"
            )
            assert math.isclose(post.item(), ref_post, rel_tol=rtol, abs_tol=atol), (
                f"model {i} step {step}: clipped grad norm {post.item()} != reference {ref_post}"
            )
            norms.append(norm)
            opt.step()
            opt.zero_grad()
            avg = loss.detach().clone()
            dist.all_reduce(avg)
            out["losses"][i].append(avg.item() / world)
        ref_opt.step()
        ref_opt.zero_grad()
        out["norms"].append((ref_norm, *norms))
    ref_params = dict(ref.named_parameters())
    for model in models:
        for name, p in model.named_parameters():
            torch.testing.assert_close(
                full(p.detach()),
                ref_params[name].detach(),
                atol=atol,
                rtol=rtol,
                msg=lambda m, n=name: f"{n}: {m}",
            )
    return out
