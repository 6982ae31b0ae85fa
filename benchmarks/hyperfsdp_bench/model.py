"""A small Llama-like decoder: token embedding, RMSNorm, causal attention, SwiGLU MLP, head."""

from __future__ import annotations

import math

import attrs
import torch
from torch import nn

from hyperfsdp_core.testing import reference


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


class Transformer(reference.Transformer):
    """``hyperfsdp_core.testing.reference.Transformer`` with separate q/k/v projections (as
    ``hyperfsdp_tp.testing.parallelize`` wants), GPT-2/Llama-style init, and the loss as
    its output."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(
            cfg.vocab,
            cfg.dim,
            cfg.n_layers,
            cfg.n_heads,
            cfg.hidden,
            fused_qkv=False,
            scaled_embedding=False,
        )
        self.cfg = cfg
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
        return reference.lm_loss(super().forward(tokens), targets)


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
