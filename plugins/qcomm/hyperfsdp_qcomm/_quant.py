"""Block-wise symmetric int8 quantization, packed for the wire.

A row of ``n`` values is cut into ``ceil(n / block)`` blocks of ``block`` values (the last
one padded with zeros for the arithmetic only). Each block ``b`` gets one fp32 scale
``s_b = max|x| / 127`` over the block, and each value ``q = round(x / s_b)`` in
``[-127, 127]``. The packed row is ``[q as int8, n rounded up to 4 bytes | s as fp32,
one per block]``: one contiguous ``uint8`` buffer, so a row travels in one collective.

Numerical contract (per value, ``x`` finite): ``|dequantize(quantize(x)) - x| <=
max|x over its block| / 254`` plus fp32 rounding of the scale arithmetic (a few ulps of
that maximum). A block of zeros is exact. A block holding a non-finite value dequantizes
to NaN throughout (the non-finite value is not lost).
"""

from __future__ import annotations

import torch

#: largest int8 magnitude used (symmetric: -127..127, so the grid is centred on 0)
QMAX = 127


def _round4(n: int) -> int:
    return (n + 3) & ~3


def packed_size(n: int, block: int) -> int:
    """Bytes of one packed row of ``n`` values."""
    return _round4(n) + 4 * (-(-n // block))


def quantize_rows(x: torch.Tensor, block: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize each row of the 2-D floating tensor ``x`` (``(rows, n)``) into a packed
    ``(rows, packed_size(n, block))`` ``uint8`` tensor (``out`` if given)."""
    if block <= 0 or block % 4:
        raise ValueError(f"block must be a positive multiple of 4, got {block}")
    rows, n = x.shape
    nb = -(-n // block)
    n4 = _round4(n)
    xf = x.float()
    if nb * block != n:
        xf = torch.nn.functional.pad(xf, (0, nb * block - n))
    xb = xf.view(rows, nb, block)
    scale = xb.abs().amax(dim=-1).div_(QMAX)
    inv = torch.where(
        scale > 0, scale.reciprocal(), torch.zeros((), dtype=scale.dtype, device=scale.device)
    )
    q = (xb * inv.unsqueeze(-1)).round_().clamp_(-QMAX, QMAX).to(torch.int8).view(rows, nb * block)
    if out is None:
        out = torch.empty(rows, n4 + 4 * nb, dtype=torch.uint8, device=x.device)
    out[:, :n4].view(torch.int8).copy_(q[:, :n4])
    out[:, n4:].view(torch.float32).copy_(scale)
    return out


def dequantize_rows(packed: torch.Tensor, n: int, block: int) -> torch.Tensor:
    """The fp32 ``(rows, n)`` values of a packed ``(rows, packed_size(n, block))`` tensor."""
    rows = packed.shape[0]
    nb = -(-n // block)
    n4 = _round4(n)
    q = packed[:, :n].view(torch.int8)
    scale = packed[:, n4:].view(torch.float32)
    deq = torch.empty(rows, nb * block, dtype=torch.float32, device=packed.device)
    deq[:, n:].zero_()
    deq[:, :n].copy_(q)
    deq.view(rows, nb, block).mul_(scale.unsqueeze(-1))
    return deq[:, :n]


def error_bound(x: torch.Tensor, block: int) -> torch.Tensor:
    """The per-value bound of the contract for the rows of ``x``: ``max|x| / 254`` of each
    value's block, plus a few fp32 ulps of it."""
    rows, n = x.shape
    nb = -(-n // block)
    xf = torch.nn.functional.pad(x.float().abs(), (0, nb * block - n))
    amax = xf.view(rows, nb, block).amax(dim=-1, keepdim=True)
    bound = amax / (2 * QMAX) + amax * (4 * torch.finfo(torch.float32).eps)
    return bound.expand(rows, nb, block).reshape(rows, nb * block)[:, :n]
