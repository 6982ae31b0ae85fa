"""Where a bucket's gradient reduction divides, and by what: the same arithmetic as FSDP2.

FSDP2 (torch 2.13) averages with the collective itself where it can (``ReduceOp.AVG``
on the reduce-scatter, and on the HSDP all-reduce), which on gloo is a SUM followed by
a true division by the group size. It sums and divides separately when the reduce
dtype can overflow (fp16, fp64): by a power of two before, by the rest after.

hyperfsdp's collectives are always plain SUMs; to produce the very same bits it divides
at the same points, with ``Tensor.div_`` by the same Python float:

- ``before``: the packed reduce-scatter input, before the collective;
- ``after_scatter``: this rank's reduce-scatter output, before any all-reduce;
- ``after_all_reduce``: the replicate all-reduce's result (HSDP and DDP topologies;
  ``None`` when there is no all-reduce).

A custom divide factor ``f`` (``set_gradient_divide_factor``) is applied right after the
reduce-scatter (FSDP2: ``AVG`` when ``f`` is the shard size, which gloo computes this
way; otherwise a pre-multiplied sum, which gloo cannot run), and the all-reduce then
sums only. Dividing by 1 is exact, so it is skipped.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

#: reduce dtypes FSDP2 averages inside the collective (no overflow concern)
_AVERAGED_IN_COLLECTIVE = (torch.float32, torch.bfloat16)


class Divisors(NamedTuple):
    before: float | None
    after_scatter: float | None
    after_all_reduce: float | None


def _nontrivial(x: float | None) -> float | None:
    return None if x is None or x == 1 else float(x)


def _power_of_two_split(factor: float) -> float:
    """The power of two FSDP2 divides by before the sum (about sqrt(factor))."""
    pre = 1
    while factor % pre == 0 and factor / pre > pre:
        pre *= 2
    return float(pre)


def gradient_divisors(
    shard_size: int,
    replicate_size: int,
    reduce_dtype: torch.dtype,
    factor: float | None = None,
) -> Divisors:
    """Divisors for one bucket (see the module docstring). ``factor``: the unit's divide
    factor; ``None`` or the data-parallel size ``shard_size * replicate_size`` is the default
    average."""
    dp = shard_size * replicate_size
    custom = factor is not None and float(factor) != float(dp)
    if reduce_dtype in _AVERAGED_IN_COLLECTIVE:
        if custom:
            return Divisors(None, _nontrivial(factor), None)
        return Divisors(None, _nontrivial(shard_size), _nontrivial(replicate_size))
    total = float(factor) if custom else float(dp)
    pre = _power_of_two_split(total)
    post = total / pre
    if replicate_size > 1:
        return Divisors(_nontrivial(pre), None, _nontrivial(post))
    return Divisors(_nontrivial(pre), _nontrivial(post), None)
