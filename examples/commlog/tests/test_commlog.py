"""The example plugin, tested as its author would: installed, on several ranks."""

import contextlib
import io
import os
import subprocess
import sys

import torch
from hyperfsdp_commlog import plugin as commlog
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from hyperfsdp_core import fully_shard
from hyperfsdp_core.plugin import get_plugin_manager
from hyperfsdp_core.testing.counting import CollectiveCounter


def model_and_step(mesh_shape):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
    names = ("replicate", "shard") if len(mesh_shape) == 2 else None
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, lambda: model(torch.randn(4, 8)).sum().backward()


def rank_summary(mesh_shape, enabled):
    if enabled:
        os.environ[commlog.ENV] = "1"  # the harness restores the environment afterwards
    _, step = model_and_step(mesh_shape)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), CollectiveCounter() as counter:
        step()
        step()
    order = [p.name for p in get_plugin_manager().finalization_phases()]
    return err.getvalue(), counter.calls, order


def test_discovered_through_its_entry_point():
    pm = get_plugin_manager()
    assert pm.get_plugin("commlog") is commlog
    info = {i.name: i for i in pm.plugin_infos()}["commlog"]
    assert info.distribution == "hyperfsdp-commlog"
    out = subprocess.run(
        [sys.executable, "-m", "hyperfsdp_core", "plugins"], capture_output=True, text=True
    ).stdout
    rows = [line.split() for line in out.splitlines()]
    assert ["commlog", "hyperfsdp-commlog", "0.1.0", ">=1.0,<2"] in rows
    assert any(line.endswith(". commlog.summary  (commlog)") for line in out.splitlines())


def counted(text: str, kind: str) -> int:
    """Total ``n=`` over the summary lines of one kind."""
    return sum(
        int(line.split("n=")[1].split()[0])
        for line in text.splitlines()
        if line.startswith("[commlog]   " + kind + " ")
    )


def test_summary_after_each_backward_on_fsdp(run_ranks):
    for text, calls, order in run_ranks(2, rank_summary, (2,), True, timeout=120):
        assert order.index("commlog.summary") > order.index("dp.all_reduce")
        headers = [line for line in text.splitlines() if "collectives since" in line]
        assert len(headers) == 2  # one summary per backward
        assert sum(int(h.split()[1]) for h in headers) == len(calls)
        assert counted(text, "all_gather") == sum(1 for k, *_ in calls if k == "ag")
        assert counted(text, "reduce_scatter") == sum(1 for k, *_ in calls if k == "rs") == 4
        assert "[commlog]   all_gather     group=2   unit=0 " in text
        assert "[commlog]   reduce_scatter group=2   unit=<root> " in text


def test_hsdp_all_reduces_are_logged(run_ranks):
    for text, calls, _ in run_ranks(4, rank_summary, (2, 2), True, timeout=120):
        assert "[commlog]   all_reduce     group=2 " in text
        assert counted(text, "all_reduce") == sum(1 for k, *_ in calls if k == "ar") == 4


def test_silent_unless_enabled(run_ranks):
    for text, calls, _ in run_ranks(2, rank_summary, (2,), False, timeout=120):
        assert text == "" and calls  # collectives ran, nothing logged


def test_summarize_groups_by_kind_size_and_unit():
    from hyperfsdp_core.plugin import CollectiveEvent

    f32 = torch.float32
    events = [
        CollectiveEvent("all_gather", 2, 100, f32, "0"),
        CollectiveEvent("all_gather", 2, 50, f32, "0"),
        CollectiveEvent("reduce_scatter", 2, 100, f32, ""),
    ]
    assert commlog.summarize(events) == [
        "all_gather     group=2   unit=0          n=2 bytes=150",
        "reduce_scatter group=2   unit=<root>     n=1 bytes=100",
    ]
