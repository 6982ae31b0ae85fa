"""Pure shape math for sharding: no torch.distributed, no tensors.

One parameter is sharded on ``dim`` over ``world`` ranks with ``torch.chunk``
semantics: ``C = ceil(D / W)`` rows per rank, the last ranks may own fewer (even
zero) rows, and every rank's communication slot has ``C`` rows (the padded shape).
"""

from __future__ import annotations

import math

import attrs


def _tuple_of_ints(value) -> tuple[int, ...]:
    return tuple(int(x) for x in value)


@attrs.frozen
class ShardLayout:
    """Where one rank's shard of one parameter lies.

    >>> lay = ShardLayout((10, 3), dim=0, world=4, rank=3)
    >>> lay.actual_shape, lay.padded_shape, lay.offset
    ((1, 3), (3, 3), 9)
    """

    global_shape: tuple[int, ...] = attrs.field(converter=_tuple_of_ints)
    dim: int
    world: int
    rank: int

    @property
    def chunk(self) -> int:
        """Rows per rank slot, ``ceil(D / W)``."""
        return math.ceil(self.global_shape[self.dim] / self.world)

    @property
    def actual_len(self) -> int:
        size = self.global_shape[self.dim]
        return max(0, min(size - self.rank * self.chunk, self.chunk))

    @property
    def offset(self) -> int:
        """Global index of this rank's first row (``D`` for an empty shard, as DTensor does)."""
        return min(self.rank * self.chunk, self.global_shape[self.dim])

    @property
    def actual_shape(self) -> tuple[int, ...]:
        return self._with_dim(self.actual_len)

    @property
    def padded_shape(self) -> tuple[int, ...]:
        return self._with_dim(self.chunk)

    @property
    def row_numel(self) -> int:
        """Elements per index of the sharded dim."""
        return math.prod(s for i, s in enumerate(self.global_shape) if i != self.dim)

    @property
    def actual_numel(self) -> int:
        return math.prod(self.actual_shape)

    @property
    def padded_numel(self) -> int:
        return math.prod(self.padded_shape)

    @property
    def is_even(self) -> bool:
        """True when every rank's actual shard equals the padded slot (no padding anywhere)."""
        return self.global_shape[self.dim] % self.world == 0

    @property
    def padding_numel(self) -> int:
        """Padding elements this rank's slot holds."""
        return self.padded_numel - self.actual_numel

    def _with_dim(self, n: int) -> tuple[int, ...]:
        shape = list(self.global_shape)
        shape[self.dim] = n
        return tuple(shape)


@attrs.frozen
class Segment:
    """One parameter's slot in a flat per-rank buffer of a bucket."""

    offset: int
    numel: int


def pack_segments(numels: list[int]) -> tuple[list[Segment], int]:
    """Lay ``numels`` back to back; returns the segments and the total."""
    segments, offset = [], 0
    for n in numels:
        segments.append(Segment(offset, n))
        offset += n
    return segments, offset


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Strides of a contiguous tensor of ``shape``."""
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))
