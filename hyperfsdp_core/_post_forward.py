"""The post-forward shard of a bucket (``reshard_after_forward=<int>``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ._buffers import alias, free
from ._layout import ShardLayout, contiguous_strides, pack_segments
from ._mesh_info import MeshInfo
from ._param import placements_for

if TYPE_CHECKING:
    from ._group import Bucket


class PostForward:
    """A bucket's post-forward shard over the smaller group (``reshard_after_forward=<int>``).

    Each member's ``torch.chunk`` chunk over that group, padded to its slot, back to back
    in ``flat`` (the backward's all-gather input); each actual chunk is the local tensor of
    the member's post-forward DTensor. ``flat`` is allocated per forward and freed once
    gathered from (or dropped), like the unsharded buffer; the DTensors stay valid.
    """

    def __init__(self, bucket: Bucket, info: MeshInfo) -> None:
        size, rank = info.shard_size, info.shard_rank
        self.info = info
        self.layouts = [
            ShardLayout(p.unsharded_shape, p.shard_dim, world=size, rank=rank)
            for p in bucket.params
        ]
        self.segments, self.total = pack_segments([lay.padded_numel for lay in self.layouts])
        self.gather_layout = (size, self.total, self.segments, self.layouts)
        first = bucket.params[0]
        self.direct = (
            len(bucket.params) == 1
            and first.shard_dim == 0
            and size * self.total == bucket.world * bucket.total
        )
        self.params = []
        with torch.inference_mode(False), torch.no_grad():  # persistent, as init_unsharded
            self.flat = torch.empty(self.total, dtype=bucket.param_dtype, device=bucket.device)
            for p, lay, seg in zip(bucket.params, self.layouts, self.segments):
                local = alias(
                    self.flat, seg.offset, lay.actual_shape, contiguous_strides(lay.actual_shape)
                )
                dt = DTensor.from_local(
                    local,
                    info.mesh,
                    placements_for(info, p.shard_dim),
                    run_check=False,
                    shape=torch.Size(p.unsharded_shape),
                    stride=p.unsharded_stride,
                )
                self.params.append(nn.Parameter(dt, requires_grad=p.requires_grad))
        free(self.flat)
