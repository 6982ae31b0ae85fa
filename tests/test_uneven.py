"""Dim-0 uneven sharding: torch.chunk shards, padding only where needed, parity."""

import pytest
import torch
from torch import nn

from hyperfsdp_core import fully_shard
from hyperfsdp_core.engine.param import StorageOwner
from hyperfsdp_core.testing.reference import train_parity


class Rows(nn.Module):
    """One weight of ``rows`` x 3 plus a small even layer, so units hold several params."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.inner = nn.Linear(3, rows, bias=False)
        self.outer = nn.Linear(rows, 2)

    def forward(self, x):
        return self.outer(torch.tanh(self.inner(x)))


def bucket_of(module):
    (bucket,) = module._hyperfsdp_state.group.buckets
    return bucket


def uneven_rank(rows, world_expected_lengths):
    import torch.distributed as dist

    rank = dist.get_rank()

    def shard(m):
        fully_shard(m.inner)  # one parameter: rows x 3
        fully_shard(m)

    def batch(step):
        x = torch.randn(8, 3, generator=torch.Generator().manual_seed(step))
        return x, x

    result = {}

    def shard_and_inspect(m):
        shard(m)
        w = m.inner.weight
        local = w.to_local()
        bucket = bucket_of(m.inner)
        result["local_shape"] = tuple(local.shape)
        result["padded"] = bucket.payload.total
        result["flat_is_storage"] = (
            local.numel() == 0 or local.data_ptr() == bucket.payload.sharded_flat.data_ptr()
        )
        result["owner"] = str(bucket.storage_owner)

    out = train_parity(
        lambda: Rows(rows), shard_and_inspect, batch, lambda o, _: o.pow(2).mean(), steps=4
    )
    expected = world_expected_lengths[rank]
    assert result["local_shape"] == (expected, 3), result
    assert result["flat_is_storage"], (
        "the local shard must live in the bucket's flat (all-gather input) storage"
    )
    return result, out["losses"]


def uneven_padding_after_steps(rows):
    """Train a few steps, then check the padded tail of the flat storage is still zero."""
    torch.manual_seed(0)
    model = Rows(rows)
    fully_shard(model.inner)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    for step in range(3):
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(step))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    bucket = bucket_of(model.inner)
    lay = bucket.params[0].layout
    flat = bucket.payload.sharded_flat
    padding = flat[lay.actual_numel : lay.padded_numel]
    return (
        padding.numel(),
        bool((padding == 0).all()),
        sum(p.layout.padding_numel for p in bucket.params),
    )


@pytest.mark.parametrize(
    ("rows", "world", "lengths"),
    [(5, 2, [3, 2]), (2, 4, [1, 1, 0, 0]), (10, 4, [3, 3, 3, 1]), (8, 2, [4, 4])],
)
def test_uneven_dim0_parity(run_ranks, rows, world, lengths):
    results = run_ranks(world, uneven_rank, rows, lengths)
    chunk = -(-rows // world)
    for info, _ in results:
        assert info["padded"] == chunk * 3  # every rank's slot is C rows, whatever it owns
        assert info["owner"] == str(StorageOwner.ALL_GATHER_OUTPUT)
    pads = run_ranks(world, uneven_padding_after_steps, rows)
    for rank, (numel, all_zero, padding_numel) in enumerate(pads):
        assert numel == (chunk - lengths[rank]) * 3 == padding_numel
        assert all_zero, f"rank {rank}: padding changed"


def even_has_no_padding():
    torch.manual_seed(0)
    model = Rows(8)
    fully_shard(model.inner)
    fully_shard(model)
    bucket = bucket_of(model.inner)
    local = model.inner.weight.to_local()
    model(torch.randn(2, 3))  # lazy init + one all-gather
    return {
        "padding": sum(p.layout.padding_numel for p in bucket.params),
        "total": bucket.payload.total,
        "actual": local.numel(),
        # the all-gather input *is* the local shard's storage: no copy-in, no padding buffer
        "same_storage": local.untyped_storage().data_ptr()
        == bucket.payload.sharded_flat.data_ptr(),
        "same_start": local.data_ptr() == bucket.payload.sharded_flat.data_ptr(),
        "storage_bytes": bucket.payload.sharded_flat.untyped_storage().nbytes(),
    }


def test_even_shape_allocates_no_padding(run_ranks):
    for info in run_ranks(2, even_has_no_padding):
        assert info["padding"] == 0
        assert info["total"] == info["actual"] == 12
        assert info["same_storage"] and info["same_start"]
        assert info["storage_bytes"] == 12 * 4
