"""Pure shape math (no processes): torch.chunk semantics, padding, offsets."""

import pytest
import torch

from hyperfsdp_core.engine.layout import ShardLayout, pack_segments


@pytest.mark.parametrize(
    ("size", "world", "lengths"),
    [
        (5, 2, [3, 2]),
        (2, 4, [1, 1, 0, 0]),
        (10, 4, [3, 3, 3, 1]),
        (8, 2, [4, 4]),
        (1, 2, [1, 0]),
        (0, 2, [0, 0]),
    ],
)
def test_actual_lengths_follow_torch_chunk(size, world, lengths):
    actual = [ShardLayout((size, 2), dim=0, world=world, rank=r).actual_len for r in range(world)]
    assert actual == lengths
    chunks = [c.shape[0] for c in torch.arange(size).chunk(world)] if size else []
    assert lengths[: len(chunks)] == chunks
    assert sum(lengths) == size


def test_five_rows_over_two_ranks():
    r0, r1 = (ShardLayout((5, 3), dim=0, world=2, rank=r) for r in (0, 1))
    assert (r0.actual_shape, r1.actual_shape) == ((3, 3), (2, 3))
    assert (r0.offset, r1.offset) == (0, 3)
    assert r0.padded_shape == r1.padded_shape == (3, 3)
    assert (r0.padding_numel, r1.padding_numel) == (0, 3)
    assert not r0.is_even


def test_two_rows_over_four_ranks_keep_other_dims():
    lays = [ShardLayout((2, 3), dim=0, world=4, rank=r) for r in range(4)]
    assert [lay.actual_shape for lay in lays] == [(1, 3), (1, 3), (0, 3), (0, 3)]
    assert [lay.offset for lay in lays] == [0, 1, 2, 2]
    assert all(lay.padded_shape == (1, 3) for lay in lays)


def test_ten_rows_over_four_is_chunk_not_balanced():
    lays = [ShardLayout((10, 3), dim=0, world=4, rank=r) for r in range(4)]
    assert [lay.actual_len for lay in lays] == [3, 3, 3, 1]  # not 3/3/2/2


def test_even_shape_has_no_padding():
    lay = ShardLayout((8, 3), dim=0, world=2, rank=1)
    assert lay.is_even and lay.actual_shape == lay.padded_shape == (4, 3)
    assert lay.padding_numel == 0


def test_non_zero_dim():
    lay = ShardLayout((3, 8, 2), dim=1, world=4, rank=2)
    assert lay.actual_shape == (3, 2, 2)
    assert lay.offset == 4
    assert lay.row_numel == 6


def test_pack_segments():
    segs, total = pack_segments([6, 0, 4])
    assert [(s.offset, s.numel) for s in segs] == [(0, 6), (6, 0), (6, 4)]
    assert total == 10
