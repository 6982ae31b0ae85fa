"""The post-forward shard of a bucket (``reshard_after_forward=<int>``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .buffers import alias, alloc, free
from .layout import ShardLayout, contiguous_strides, pack_segments
from .mesh_info import MeshInfo
from .param import placements_for

if TYPE_CHECKING:
    from .param import ShardedParam


class PostForward:
    """A bucket's post-forward shard over the smaller group (``reshard_after_forward=<int>``).

    Each member's ``torch.chunk`` chunk over that group, padded to its slot, back to back
    in ``flat`` (the backward's all-gather input); each actual chunk is the local tensor of
    the member's post-forward DTensor. ``flat`` is allocated per forward and freed once
    gathered from (or dropped), like the unsharded buffer; the DTensors stay valid.
    """

    def __init__(
        self,
        params: list[ShardedParam],
        info: MeshInfo,
        *,
        gathered_numel: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """``params``: the bucket's members; ``gathered_numel``: the elements of its
        all-gather over the full shard group (``world * total``)."""
        size, rank = info.shard_size, info.shard_rank
        self.info = info
        self.layouts = [
            ShardLayout(p.unsharded_shape, p.shard_dim, world=size, rank=rank) for p in params
        ]
        self.segments, self.total = pack_segments([lay.padded_numel for lay in self.layouts])
        self.gather_layout = (size, self.total, self.segments, self.layouts)
        first = params[0]
        self.direct = (
            len(params) == 1 and first.shard_dim == 0 and size * self.total == gathered_numel
        )
        self.params = []
        with torch.inference_mode(False), torch.no_grad():  # persistent, as init_unsharded
            self.flat = torch.empty(self.total, dtype=dtype, device=device)
            for p, lay, seg in zip(params, self.layouts, self.segments):
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

    def keep(self, params: list[ShardedParam]) -> None:
        """Allocate ``flat`` and copy each member's chunk over the smaller group into it,
        from its unsharded parameter (``reshard_after_forward=<int>``)."""
        alloc(self.flat)
        for p, lay, seg in zip(params, self.layouts, self.segments):
            if lay.actual_len:
                src = p.unsharded_param.detach().narrow(p.shard_dim, lay.offset, lay.actual_len)
                self.flat[seg.offset : seg.offset + lay.actual_numel].view(lay.actual_shape).copy_(
                    src
                )
