"""A tiny Hugging Face Llama built from a config (no downloads) and learnable token batches,
for the tests that drive frameworks (accelerate, Lightning) through ``use_as_fsdp2()``."""

from __future__ import annotations

VOCAB, SEQ = 96, 12


def tiny_llama(tied: bool):
    """``LlamaForCausalLM`` with 3 decoder layers of width 32 (GQA), seeded; ``tied`` ties
    ``lm_head`` to the input embedding."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    return model


def token_batch(step: int, n: int):
    """``n`` learnable sequences: arithmetic progressions mod ``VOCAB`` (random start and
    stride), the same on every rank for a step."""
    import torch

    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    return (start + stride * torch.arange(SEQ)) % VOCAB
