"""Small models and a parity driver: train a sharded copy and an unsharded reference.

Every rank builds the same model (same seed), keeps an unsharded deep copy as the
reference, trains the reference on the *global* batch and the sharded model on its
rank's slice of it, and compares losses and parameters. Plugin test suites use the
same helpers.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

# -- models ---------------------------------------------------------------------------------------


class MLPStack(nn.Module):
    """Linear layers with ReLU between them; ``dims`` may be uneven on purpose."""

    def __init__(self, dims: list[int], bias: bool = True) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=bias) for a, b in itertools.pairwise(dims))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.relu(x)
        return x


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = x.float().pow(2).mean(-1, keepdim=True).add(self.eps).rsqrt()
        return (x.float() * norm).type_as(x) * self.weight


class Attention(nn.Module):
    """Causal self-attention without biases.

    ``fused_qkv``: one ``wqkv`` projection split into ``n_heads`` heads; otherwise separate
    ``wq``, ``wk``, ``wv`` whose head count follows from their output width, so that
    column-wise tensor parallelism of the projections splits whole heads.
    """

    def __init__(self, dim: int, n_heads: int, fused_qkv: bool = True) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = dim // n_heads
        self.fused_qkv = fused_qkv
        if fused_qkv:
            self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        else:
            self.wq = nn.Linear(dim, dim, bias=False)
            self.wk = nn.Linear(dim, dim, bias=False)
            self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        if self.fused_qkv:
            qkv = self.wqkv(x).view(b, t, 3, self.n_heads, self.head_dim).unbind(2)
            q, k, v = (y.transpose(1, 2) for y in qkv)
        else:
            q, k, v = (
                w(x).view(b, t, -1, self.head_dim).transpose(1, 2)
                for w in (self.wq, self.wk, self.wv)
            )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """SwiGLU: ``w2(silu(w1(x)) * w3(x))``, without biases."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, hidden: int, fused_qkv: bool = True) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(dim)
        self.attn = Attention(dim, n_heads, fused_qkv)
        self.mlp_norm = RMSNorm(dim)
        self.mlp = MLP(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """A small Llama-like model: embedding, blocks, final norm, (optionally tied) head.

    The tensor-parallel plugin's test model and the benchmark's are this one with
    ``fused_qkv=False`` (separate ``wq``, ``wk``, ``wv``, see :class:`Attention`) and
    ``scaled_embedding=False`` (the embedding keeps ``nn.Embedding``'s N(0, 1) init instead
    of N(0, 1/dim)); each initializes further after construction.
    """

    def __init__(
        self,
        vocab: int = 37,
        dim: int = 16,
        n_layers: int = 2,
        n_heads: int = 2,
        hidden: int = 27,
        tied: bool = False,
        *,
        fused_qkv: bool = True,
        scaled_embedding: bool = True,
    ) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        if scaled_embedding:  # O(1) logits when tied
            nn.init.normal_(self.tok_embeddings.weight, std=dim**-0.5)
        self.layers = nn.ModuleList(Block(dim, n_heads, hidden, fused_qkv) for _ in range(n_layers))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


# -- data and losses ------------------------------------------------------------------------------


def mlp_batch(step: int, global_batch: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(global_batch, dim, generator=g)
    return x, x  # the loss below only uses the output


def token_batch(
    step: int, global_batch: int, seq: int, vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    tokens = torch.randint(0, vocab, (global_batch, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def mse_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def lm_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1).float(), target.flatten())


def local_slice(t: torch.Tensor, rank: int | None = None, world: int | None = None) -> torch.Tensor:
    rank = dist.get_rank() if rank is None else rank
    world = dist.get_world_size() if world is None else world
    return t.chunk(world)[rank]


# -- comparison -----------------------------------------------------------------------------------


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def assert_close_params(
    model: nn.Module, ref: nn.Module, atol: float = 1e-5, rtol: float = 1e-4
) -> None:
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(
            full(p.detach()),
            full(ref_params[name].detach()),
            atol=atol,
            rtol=rtol,
            msg=lambda m, n=name: f"{n}: {m}",
        )


# -- the parity driver ------------------------------------------------------------------------------


def train_parity(
    build: Callable[[], nn.Module],
    shard: Callable[[nn.Module], Any],
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    steps: int = 3,
    lr: float = 1e-2,
    atol: float = 1e-5,
    rtol: float = 1e-4,
    clip: float | None = None,
    ref_cast: Callable[[nn.Module], Any] | None = None,
) -> dict[str, Any]:
    """Train ``shard(build())`` and an unsharded copy in lockstep; assert parity each step.

    Returns the per-step losses (sharded: averaged over ranks) and the final
    parameter differences, for the caller to assert more.
    """
    torch.manual_seed(0)
    model = build()
    ref = copy.deepcopy(model)
    if ref_cast is not None:
        ref_cast(ref)
    shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=0.01)
    losses, ref_losses, norms = [], [], []
    world = dist.get_world_size()
    for step in range(steps):
        x, y = batch(step)
        ref_loss = loss_fn(ref(x), y)
        ref_loss.backward()
        loss = loss_fn(model(local_slice(x)), local_slice(y))
        loss.backward()
        if clip is not None:
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            norms.append((full(norm).item(), ref_norm.item()))
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        losses.append(avg.item() / world)
        ref_losses.append(ref_loss.item())
        assert math.isclose(losses[-1], ref_losses[-1], rel_tol=rtol * 10, abs_tol=atol * 10), (
            f"step {step}: loss {losses[-1]} != reference {ref_losses[-1]}"
        )
    assert_close_params(model, ref, atol=atol, rtol=rtol)
    return {"losses": losses, "ref_losses": ref_losses, "norms": norms}
