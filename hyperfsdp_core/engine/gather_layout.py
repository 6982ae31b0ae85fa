"""Where an all-gather's rows go: the views of a bucket's unsharded buffer that the gloo
routes gather into (:class:`GatherViews`, :func:`gather_views`), and the copy of a rank-major gather output into
the param-major unsharded buffer (:func:`copy_out`). Pure tensor layout, no state."""

from __future__ import annotations

import math

import torch

from .._torch_private import foreach_copy_, foreach_zero_


class GatherViews:
    """Views of a bucket's unsharded buffer for the gloo all-gathers that write into it in
    place: the peers' parts (``zero``), this rank's parts (``own``) and the shards that fill
    them (``src``), and -- when every member is sharded on dim 0 -- each member's
    ``(world, rows)`` view (``rows``, point-to-point)."""

    __slots__ = ("own", "rows", "src", "zero")

    def __init__(self, zero: list, own: list, src: list, rows: list | None) -> None:
        self.zero, self.own, self.src, self.rows = zero, own, src, rows

    def fill_all(self) -> None:
        """All-gather by all-reduce: this rank's shards (cast if needed) into its parts,
        zeros everywhere else."""
        if self.zero:
            foreach_zero_(self.zero)
        foreach_copy_(self.own, self.src)

    def fill_own(self) -> None:
        """All-gather by point-to-point: this rank's shards (cast if needed) into its rows;
        the peers' rows are received into place."""
        foreach_copy_(self.own, self.src)


def gather_views(
    params: list,
    segments: list,
    flat: torch.Tensor,
    sharded: torch.Tensor,
    world: int,
    rank: int,
) -> GatherViews:
    """Views of the unsharded buffer for the gloo all-gathers (see :class:`GatherViews`)."""
    zero: list[torch.Tensor] = []
    own: list[torch.Tensor] = []
    src: list[torch.Tensor] = []
    rows_p2p: list[torch.Tensor] | None = []
    for p, seg in zip(params, segments):
        region = flat[world * seg.offset : world * (seg.offset + seg.numel)]
        shard = sharded[seg.offset : seg.offset + seg.numel]
        if p.shard_dim == 0:  # rank r's padded shard is row r (as in copy_out)
            rows = region.view(world, seg.numel)
            own.append(rows[rank])
            src.append(shard)
            parts = (rows[:rank], rows[rank + 1 :])
            if rows_p2p is not None and seg.numel:
                rows_p2p.append(rows)
        else:  # chunk r of dim `dim` (even by construction)
            lay = p.layout
            pre = math.prod(lay.global_shape[: lay.dim])
            post = math.prod(lay.global_shape[lay.dim + 1 :])
            grid = region.view(pre, world, lay.chunk, post)
            own.append(grid[:, rank])
            src.append(shard.view(pre, lay.chunk, post))
            parts = (grid[:, :rank], grid[:, rank + 1 :])
            rows_p2p = None
        zero += [t for t in parts if t.numel()]
    return GatherViews(zero, own, src, rows_p2p or None)


def copy_out(
    params: list,
    own_segments: list,
    bucket_world: int,
    flat: torch.Tensor,
    staging: torch.Tensor,
    layout: tuple,
) -> None:
    """Rank-major gather output -> the param-major unsharded buffer.

    ``layout`` is ``(ranks, total, segments, shard layouts)`` of the gather: the
    bucket's own, or its post-forward one (fewer ranks, larger slots; a member's rows
    then fill only the front of its padded region, the rest is never visible).
    """
    world, total, segments, layouts = layout
    src = staging.view(world, total)
    dim0_src, dim0_sizes, dim0_out = [], [], []
    for p, own, seg, lay in zip(params, own_segments, segments, layouts):
        region = flat[bucket_world * own.offset : bucket_world * (own.offset + own.numel)]
        if p.shard_dim == 0:
            dim0_sizes.append(seg.numel)
            dim0_out.append(region[: world * seg.numel].view(world, seg.numel))
            dim0_src.append(seg)
        else:
            pre = math.prod(lay.global_shape[: lay.dim])
            post = math.prod(lay.global_shape[lay.dim + 1 :])
            part = src[:, seg.offset : seg.offset + seg.numel]
            region.view(pre, world, lay.chunk, post).copy_(
                part.reshape(world, pre, lay.chunk, post).permute(1, 0, 2, 3)
            )
    if len(dim0_out) == len(params):
        torch.split_with_sizes_copy(src, dim0_sizes, dim=1, out=dim0_out)
    else:
        for seg, out in zip(dim0_src, dim0_out):
            out.copy_(src[:, seg.offset : seg.offset + seg.numel])
