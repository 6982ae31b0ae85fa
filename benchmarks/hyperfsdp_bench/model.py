"""A small Llama-like decoder: token embedding, RMSNorm, causal attention, SwiGLU MLP, head."""

from __future__ import annotations

import math

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from hyperfsdp_core.testing.reference import RMSNorm


@attrs.frozen
class ModelConfig:
    vocab: int = 8192
    dim: int = 256
    n_layers: int = 8
    n_heads: int = 4
    hidden: int = 704  # SwiGLU hidden size (~8/3 * dim)
    seq_len: int = 128
    batch: int = 2  # local batch per rank

    @property
    def n_params(self) -> int:
        d, h, v = self.dim, self.hidden, self.vocab
        per_layer = 4 * d * d + 3 * d * h + 2 * d
        return 2 * v * d + self.n_layers * per_layer + d

    def as_dict(self) -> dict:
        return {**attrs.asdict(self), "n_params": self.n_params}


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # heads from the projection's width: under tensor parallelism a rank has n_heads / tp
        shape = (b, s, -1, self.head_dim)
        q = self.wq(x).view(shape).transpose(1, 2)
        k = self.wk(x).view(shape).transpose(1, 2)
        v = self.wv(x).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w2 = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = 0.02
        nn.init.normal_(self.tok_embeddings.weight, std=std)
        for name, p in self.named_parameters():
            if p.ndim == 2 and "tok_embeddings" not in name:
                # scaled init for residual projections, as in GPT-2/Llama recipes
                scale = (
                    std / math.sqrt(2 * self.cfg.n_layers)
                    if name.endswith(("wo.weight", "w2.weight"))
                    else std
                )
                nn.init.normal_(p, std=scale)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        logits = self.output(self.norm(h))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def build_model(cfg: ModelConfig, seed: int) -> Transformer:
    """The same weights on every rank and for every implementation (seeded)."""
    torch.manual_seed(seed)
    return Transformer(cfg)


def make_batches(
    cfg: ModelConfig, seed: int, rank: int, count: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` distinct local batches for ``rank``, identical for every implementation."""
    batches = []
    for i in range(count):
        g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 7919 + i)
        data = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq_len + 1), generator=g)
        batches.append((data[:, :-1].contiguous(), data[:, 1:].contiguous()))
    return batches
