"""A collective that fails because a peer died names the unit, the collective and the bytes
(issue 30, item 4), on every CPU transport.

Two processes train a small stack; rank 1 dies at the start of its backward. Rank 0's next
collective fails (gloo: the connection closed; shared memory: the peer is gone), and the
exception it gets keeps its type and message but carries a note naming the unit's FQN, the
collective kind and its size in bytes.
"""

import multiprocessing as mp
import os
import tempfile

import pytest

WORLD = 2
TIMEOUT_S = 20


def _rank(rank: int, init_file: str, env: dict, queue) -> None:
    import datetime
    import faulthandler

    faulthandler.dump_traceback_later(TIMEOUT_S * 4, exit=True)  # never outlive the test
    os.environ.update(env)

    import torch
    import torch.distributed as dist
    from torch import nn

    from hyperfsdp_core import fully_shard

    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(3)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    loss = model(torch.randn(4, 32)).sum()
    loss.backward()  # a whole step first: every transport is set up
    loss = model(torch.randn(4, 32)).sum()
    if rank == 1:
        os._exit(3)  # dies before its backward
    try:
        loss.backward()
    except Exception as e:  # the failure under test
        queue.put((type(e).__name__, str(e), list(getattr(e, "__notes__", []))))
    else:
        queue.put(("no error", "", []))
    queue.close()
    queue.join_thread()  # flushed before the hard exit below
    os._exit(0)  # skip teardown of a group whose peer is gone


@pytest.mark.parametrize("env", [{}, {"HYPERFSDP_SHM": "0"}], ids=["shared_memory", "gloo"])
def test_dead_peer_mid_backward_names_unit_collective_and_bytes(env):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [
            ctx.Process(target=_rank, args=(r, init_file, env, queue), daemon=True)
            for r in range(WORLD)
        ]
        for p in procs:
            p.start()
        try:
            kind, message, notes = queue.get(timeout=TIMEOUT_S * 3)
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    assert kind != "no error"
    note = "\n".join(notes)
    assert "hyperfsdp:" in note, (kind, message, notes)
    assert any(k in note for k in ("all_gather", "reduce_scatter")), note
    assert "unit '" in note and "bytes" in note, note
    # the unit is named by its FQN: a layer of the stack or the root
    assert any(f"'{i}'" in note for i in range(3)) or "'<root>'" in note, note
