"""Resharding on load: world 2 -> 4 (zero-row shards), 4 -> 2, FSDP <-> HSDP (2, 2), meta init.

Each checkpoint is saved once by a sharded model trained in lockstep with an unsharded
reference; each load must reproduce the saved parameters and optimizer state bit for bit,
and the next training step must match the reference.
"""

import pytest
import torch
from dcp_testlib import (
    MLP_DIMS,
    ResetRecorder,
    assert_all_reset,
    assert_bitwise,
    assert_close_loss,
    assert_params_close,
    build,
    chunk_report,
    full_state,
    local_shapes,
    make_mesh,
    optimizer,
    reference,
    shard,
    train_step,
    trained,
)
from hyperfsdp_dcp import load_checkpoint, save_checkpoint

from hyperfsdp_core.testing import run_on_ranks

KIND = "mlp"
STEPS = 2


def save(path, layout):
    model, opt, _, _ = trained(KIND, STEPS, make_mesh(layout))
    save_checkpoint(path, model, opt, step=STEPS)
    return full_state(model, opt), local_shapes(model)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(world, layout) -> (path, full state at save, each rank's local shapes), saved lazily
    once per module (and xdist worker)."""
    cache = {}

    def get(world, layout):
        if (world, layout) not in cache:
            path = str(tmp_path_factory.mktemp(f"w{world}{layout}") / "ckpt")
            results = run_on_ranks(world, save, path, layout)
            cache[world, layout] = (path, results[0][0], [shapes for _, shapes in results])
        return cache[world, layout]

    return get


def load_and_continue(path, layout, expected, meta):
    if meta:  # no initialization at all: storage is allocated, then filled by the load
        with torch.device("meta"):
            model = build(KIND, seed=1)
        shard(model, make_mesh(layout))
        model.to_empty(device="cpu")
    else:
        model = shard(build(KIND, seed=1), make_mesh(layout))
    opt = optimizer(model)
    with ResetRecorder() as resets:
        load_checkpoint(path, model, opt)
    assert_bitwise(full_state(model, opt), expected, "after resharded load")
    assert_all_reset(model, resets)

    ref, ref_opt = reference(KIND, STEPS)
    assert_params_close(model, ref)
    for step in range(STEPS, STEPS + (2 if meta else 1)):
        loss = train_step(KIND, model, opt, step)
        ref_loss = train_step(KIND, ref, ref_opt, step, sharded=False)
        assert_close_loss(loss, ref_loss)
        assert_params_close(model, ref)
    return local_shapes(model)


MATRIX = [
    # (save world, save layout, load world, load layout, meta-device target)
    (2, "fsdp", 4, "fsdp", False),
    (4, "fsdp", 2, "fsdp", False),
    (4, "fsdp", 4, "hsdp", False),
    (4, "hsdp", 2, "fsdp", False),
    (2, "fsdp", 4, "fsdp", True),
]


@pytest.mark.parametrize(("sw", "sl", "lw", "ll", "meta"), MATRIX)
def test_reshard_on_load(run_ranks, saved, sw, sl, lw, ll, meta):
    path, expected, _ = saved(sw, sl)
    shapes = run_ranks(lw, load_and_continue, path, ll, expected, meta)
    # the target really was laid out differently (zero-row shards at world 4)
    rows = {tuple(s["layers.1.weight"]) for s in shapes}
    n = lw if ll == "fsdp" else lw // 2
    assert rows == {tuple(t.shape) for t in torch.empty(MLP_DIMS[2], MLP_DIMS[1]).chunk(n)} | (
        {(0, MLP_DIMS[1])} if n > MLP_DIMS[2] else set()
    )


@pytest.mark.parametrize(("world", "layout"), [(2, "fsdp"), (4, "fsdp"), (4, "hsdp")])
def test_checkpoint_stores_no_padding(saved, world, layout):
    path, expected, shapes = saved(world, layout)
    report = chunk_report(path)
    tensors = {k for k, v in expected.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
    assert tensors <= report.keys()
    for key, (numel, stored, disjoint) in report.items():
        assert stored == numel, f"{key}: chunks hold {stored} elements, the tensor has {numel}"
        assert disjoint, f"{key}: chunks overlap or leave holes"
    if world == 4 and layout == "fsdp":  # 3 rows over 4 ranks: the last rank holds none
        assert any(s["layers.1.weight"] == (0, MLP_DIMS[1]) for s in shapes)
