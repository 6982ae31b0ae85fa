"""torch's ``CommDebugMode`` (``torch.distributed.tensor.debug``) sees every collective the
core issues, with FSDP2's kinds and counts, on every CPU transport: shared memory, gloo
with the core's own routes (``HYPERFSDP_SHM=0``) and gloo's own collectives
(``HYPERFSDP_GLOO_NATIVE_COLLECTIVES=1``). The routes stay as they are
while a mode is active, and show the mode each collective as the c10d op FSDP2 issues.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

from hyperfsdp_core.testing.counting import CollectiveCounter
from hyperfsdp_core.testing.reference import Transformer, lm_loss, local_slice, token_batch

STEPS = 4
#: the steps run under ``CommDebugMode``: the first (lazy init, before any shared memory
#: is set up) and one after a step outside it (with shared memory set up); the last step
#: runs outside it again
COUNTED = (0, 2)
VOCAB = 33

#: how hyperfsdp's gloo collectives run: settings of the hyperfsdp-shm plugin and of the
#: core's gloo routes (what the environment variables set when a root's transport is made)
TRANSPORTS = {
    # shared memory between the ranks of this host (the default)
    "shm": {"SHM": True, "NATIVE": False, "ALL_GATHER_MIN_BYTES": 0},
    # HYPERFSDP_SHM=0: the core's gloo routes (point to point, in-place all-reduce), every size
    "gloo": {"SHM": False, "NATIVE": False, "ALL_GATHER_MIN_BYTES": 0},
    # HYPERFSDP_GLOO_NATIVE_COLLECTIVES=1: gloo's own all-gathers and reduce-scatters
    "native": {"SHM": False, "NATIVE": True},
}


def _owner(name: str):
    """The module that holds switch ``name``: the plugin's ``SHM``, else the core's gloo
    routes' (``NATIVE``, ``ALL_GATHER_MIN_BYTES``)."""
    if name == "SHM":
        from hyperfsdp_shm import _settings

        return _settings
    from hyperfsdp_core.comm import gloo

    return gloo


def shared_memory_used(model) -> bool:
    """Whether the hyperfsdp-shm transport of ``model``'s root made a shared-memory group."""
    from hyperfsdp_shm.plugin import ROOT_TRANSPORT

    from hyperfsdp_core.plugin import unit_of

    transport = unit_of(model).root.stash.get(ROOT_TRANSPORT, None)
    return transport is not None and any(g is not None for g in transport._shm.values())


def shard(model: Transformer, fully_shard, mesh, raf) -> None:
    """Units that take each of the core's gather routes: dim-0 members only (row by row),
    a unit with dim-1 members (an in-place all-reduce stand-in on gloo; not with an int
    ``raf``, which FSDP2 2.13 cannot gather back from dim-1 shards), and the root."""
    for i, block in enumerate(model.layers):
        kwargs = {"mesh": mesh, "reshard_after_forward": raf}
        if i == 1 and raf is True:
            kwargs["shard_placement_fn"] = lambda p: (
                Shard(1) if p.ndim == 2 and p.shape[1] % 4 == 0 else None
            )
        fully_shard(block, **kwargs)
    fully_shard(model, mesh=mesh)


def train_step(model, opt, step: int) -> torch.Tensor:
    x, y = token_batch(step, 8, 5, VOCAB)
    loss = lm_loss(model(local_slice(x)), local_slice(y))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def counted_training(impl: str, transport: str, layout: str):
    """Train ``STEPS`` steps, the ``COUNTED`` ones under ``CommDebugMode``, all under the
    core's own counter; check the losses against the unsharded reference and return
    CommDebugMode's counts by op name and the core counter's for the same steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    if impl == "hyperfsdp":
        from hyperfsdp_core import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    world = dist.get_world_size()
    saved = {name: getattr(_owner(name), name) for name in TRANSPORTS[transport]}
    for name, value in TRANSPORTS[transport].items():
        setattr(_owner(name), name, value)
    try:
        torch.manual_seed(0)
        model = Transformer(vocab=VOCAB, dim=16, n_layers=3, hidden=24)
        ref = copy.deepcopy(model)
        if layout == "hsdp":  # replicated over pairs: gradients all-reduced too
            mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "shard"))
        else:
            mesh = init_device_mesh("cpu", (world,))
        raf = 2 if layout == "post_forward" else True
        shard(model, fully_shard, mesh, raf)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, counts, own = [], {}, {}
        with CollectiveCounter() as counter:
            for step in range(STEPS):
                if step not in COUNTED:  # outside a mode: the core's own transports
                    losses.append(train_step(model, opt, step))
                    continue
                seen = len(counter.calls)
                # one mode per step: its module tracker supports one forward per ``with``
                with CommDebugMode() as mode:
                    losses.append(train_step(model, opt, step))
                for op, n in mode.get_comm_counts().items():
                    counts[str(op)] = counts.get(str(op), 0) + n
                for kind, *_ in counter.calls[seen:]:
                    own[kind] = own.get(kind, 0) + 1
        if impl == "hyperfsdp" and transport == "shm":  # used outside the mode
            assert shared_memory_used(model)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        for step, loss in enumerate(losses):  # the unsharded reference, on the global batch
            x, y = token_batch(step, 8, 5, VOCAB)
            ref_loss = lm_loss(ref(x), y)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            dist.all_reduce(loss)
            assert math.isclose(loss.item() / world, ref_loss.item(), rel_tol=1e-4), step
        return counts, own
    finally:
        for name, value in saved.items():
            setattr(_owner(name), name, value)


KIND = {"c10d._allgather_base_": "ag", "c10d._reduce_scatter_base_": "rs", "c10d.allreduce_": "ar"}


@pytest.mark.parametrize(
    "world,layout",
    [(2, "fsdp"), (4, "fsdp"), (4, "post_forward"), (4, "hsdp")],
)
@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_comm_debug_mode_counts_like_fsdp2(run_ranks, world, layout, transport):
    theirs = run_ranks(world, counted_training, "fsdp2", transport, layout)
    ours = run_ranks(world, counted_training, "hyperfsdp", transport, layout)
    for (counts, own), (fsdp2_counts, _) in zip(ours, theirs):
        # the same kinds and counts as FSDP2 on the same model...
        assert counts == fsdp2_counts, (counts, fsdp2_counts)
        assert set(counts) <= set(KIND), counts
        # ...and each one a collective the core's own counter saw
        assert {KIND[op]: n for op, n in counts.items()} == own
