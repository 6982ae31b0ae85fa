"""The benchmark suite's logic (no timing): case selection, references, ratios, timelines,
chart data and tables, on made-up results."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest
from hyperfsdp_bench import charts, report, suite, timeline
from hyperfsdp_bench.cases import PRESETS, Case, select_cases
from hyperfsdp_bench.impls import family, is_distributed, parse_impl

MiB = 1024 * 1024
ROOT = Path(__file__).resolve().parent.parent


def test_parse_impl_and_families():
    assert parse_impl("hyperfsdp") == ("hyperfsdp", "")
    assert parse_impl("fsdp2-foreach") == ("fsdp2", "foreach")
    assert parse_impl("hyperfsdp-no-offload") == ("hyperfsdp", "no-offload")
    assert parse_impl("fsdp2-unpinned") == ("fsdp2", "unpinned")
    assert family("floor-foreach") == "-foreach" and family("hyperfsdp-tuned") == ""
    assert is_distributed("ddp-foreach") and not is_distributed("floor-foreach")
    with pytest.raises(ValueError, match="unknown implementation"):
        parse_impl("deepspeed")


def test_case_impls_per_config():
    main = ("hyperfsdp", "fsdp2", "ddp", "floor")
    assert Case("offload", 2, 8).impls(main) == (
        *main,
        "hyperfsdp-no-offload",
        "fsdp2-unpinned",
        "fsdp2-no-offload",
    )
    assert Case("even", 2, 8).impls((*main, "fsdp2-unpinned")) == main
    assert Case("host-overhead", 1, 64).impls((*main, "ddp-foreach", "fsdp2-foreach")) == (
        "hyperfsdp",
        "fsdp2",
        "floor",
        "fsdp2-foreach",
    )
    assert Case("tp", 4, 8).impls(main) == ("hyperfsdp", "fsdp2", "floor")


def test_new_configs_and_presets():
    spec = Case("param-heavy", 2, 8).spec()
    assert (spec.model.dim, spec.model.n_layers, spec.model.batch, spec.model.seq_len) == (
        1024,
        8,
        1,
        64,
    )
    assert spec.model.dim % spec.model.n_heads == 0
    assert 100e6 < spec.model.n_params < 140e6
    assert Case("offload", 2, 8).spec().offload and not Case("even", 2, 8).spec().offload
    quick = {c.name for c in PRESETS["quick"].cases}
    assert {"param-heavy w2 L8", "offload w2 L8"} <= quick
    scaling = {(c.world, c.layers) for c in PRESETS["scaling"].cases}
    assert scaling == {(2, 4), (2, 8), (2, 16), (2, 32), (1, 8), (4, 8)}
    assert [c.name for c in select_cases(PRESETS["quick"], ["param-heavy"], None, None)] == [
        "param-heavy w2 L8"
    ]


def test_references_and_guard():
    ok = {"hyperfsdp", "fsdp2", "fsdp2-foreach", "floor", "floor-foreach", "hyperfsdp-foreach"}
    assert suite.reference_for("hyperfsdp", "even", ok) == "fsdp2"
    assert suite.reference_for("hyperfsdp-foreach", "even", ok) == "fsdp2-foreach"
    assert suite.reference_for("fsdp2-foreach", "even", ok) == "fsdp2"  # not itself
    assert suite.floor_for("hyperfsdp-foreach", ok) == "floor-foreach"
    assert suite.floor_for("hyperfsdp-foreach", {"floor"}) == "floor"
    # offload: FSDP2's own offload when it ran, else its unpinned offload
    off = {"hyperfsdp", "fsdp2-unpinned", "fsdp2-no-offload", "hyperfsdp-no-offload", "ddp"}
    assert suite.reference_for("hyperfsdp", "offload", off) == "fsdp2-unpinned"
    assert suite.reference_for("hyperfsdp", "offload", off | {"fsdp2"}) == "fsdp2"
    assert suite.reference_for("hyperfsdp-no-offload", "offload", off) == "fsdp2-no-offload"
    assert suite.reference_for("ddp", "offload", off) == "fsdp2-no-offload"
    # the loss guard's untimed references
    assert suite.guard_references(["hyperfsdp"], "even") == ["fsdp2"]
    assert suite.guard_references(["hyperfsdp", "fsdp2"], "even") == []
    assert suite.guard_references(["hyperfsdp-foreach", "fsdp2"], "even") == []
    assert suite.guard_references(["hyperfsdp", "hyperfsdp-no-offload"], "offload") == [
        "fsdp2-unpinned",
        "fsdp2-no-offload",
    ]


def _impl(median, fwd_bwd, optim, **extra):
    return {
        "status": "ok",
        "median_s": median,
        "fwd_bwd_median_s": fwd_bwd,
        "optim_median_s": optim,
        "cpu_s_per_step": median,
        "round_medians_s": [median, median],
        "peak_rss_bytes": [600 * MiB, 610 * MiB],
        "peak_heap_bytes": [300 * MiB, 290 * MiB],
        "live_bytes": [80 * MiB],
        "padding_bytes": [0],
        "collectives_per_step": 26,
        "bytes_per_step": 100 * MiB,
        "p90_s": median,
        **extra,
    }


def test_host_overhead_breakdown():
    res = {
        "case": "host-overhead w1 L64",
        "config": "host-overhead",
        "world_size": 1,
        "layers": 64,
        "impls": {
            "hyperfsdp": _impl(0.160, 0.065, 0.095),
            "fsdp2": _impl(0.200, 0.104, 0.096),
            "floor": _impl(0.065, 0.039, 0.026),
            "floor-foreach": _impl(0.060, 0.039, 0.021),
            "fsdp2-foreach": _impl(0.140, 0.104, 0.036),
            "fsdp2-unpinned": {"status": "refused: no accelerator"},
        },
    }
    suite._add_ratios(res)
    h, f, ff = res["impls"]["hyperfsdp"], res["impls"]["fsdp2"], res["impls"]["fsdp2-foreach"]
    assert h["overhead_s_per_unit_step"] == pytest.approx((0.160 - 0.065) / 65)
    assert h["engine_overhead_s_per_unit_step"] == pytest.approx((0.065 - 0.039) / 65)
    assert h["optim_overhead_s_per_unit_step"] == pytest.approx((0.095 - 0.026) / 65)
    assert h["engine_overhead_ratio_vs_fsdp2"] == pytest.approx(26 / 65)
    assert h["optim_overhead_ratio_vs_fsdp2"] == pytest.approx(69 / 70)
    assert f["ratio_vs_fsdp2"] == 1.0 and f["reference"] == "fsdp2"
    # a foreach run: against the foreach floor, and compared with FSDP2's default run
    assert ff["floor"] == "floor-foreach" and ff["reference"] == "fsdp2"
    assert ff["optim_overhead_s_per_unit_step"] == pytest.approx(0.015 / 65)
    text = report.render(
        {
            "cases": [res],
            "options": {"steps": 1, "rounds": 1, "threads_per_rank": 1},
            "machine": {},
        }
    )
    assert "engine ms/unit" in text and "optimizer ms/unit" in text
    assert "refused [1]" in text and "[1] host-overhead w1 L64 fsdp2-unpinned: refused" in text


def _timeline():
    markers = [
        (0.0, "phase", "zero_grad"),
        (0.001, "fwd", "root"),
        (0.002, "fwd", "L0"),
        (0.003, "coll", "all_gather_into_tensor 1024"),
        (0.004, "coll", "all_reduce 2048"),
        (0.010, "fwd", "L1"),
        (0.020, "bwd", "root"),
        (0.030, "bwd", "L1"),
        (0.040, "bwd", "L0"),
        (0.050, "phase", "backward end"),
        (0.050, "phase", "optimizer"),
        (0.060, "phase", "step end"),
    ]
    samples = [  # (s, heap in use, resident)
        (0.0, 100 * MiB, 400 * MiB),
        (0.005, 120 * MiB, 420 * MiB),
        (0.022, 180 * MiB, 470 * MiB),
        (0.035, 150 * MiB, 490 * MiB),
        (0.055, 160 * MiB, None),
        (0.061, 110 * MiB, 480 * MiB),
    ]
    return {"samples": samples, "markers": markers}


def test_timeline_summary():
    tl = _timeline()
    assert timeline.phase_of(tl["markers"], 0.0035) == "fwd L0"  # collectives do not count
    assert timeline.phase_of(tl["markers"], 0.055) == "optimizer"
    assert timeline.section_of(tl["markers"], 0.0) == "zero_grad"
    assert timeline.section_of(tl["markers"], 0.035) == "backward"
    info = timeline.summarize(tl)
    assert info["peak_bytes"] == 180 * MiB and info["peak_phase"] == "bwd root"
    assert (info["rss_start_bytes"], info["rss_peak_bytes"]) == (400 * MiB, 490 * MiB)
    assert info["section_peaks"] == {
        "zero_grad": 100 * MiB,
        "forward": 120 * MiB,
        "backward": 180 * MiB,
        "optimizer": 160 * MiB,
        "end": 110 * MiB,
    }
    assert info["collectives_issued_before_peak"] == [
        "all_gather_into_tensor 1024",
        "all_reduce 2048",
    ]
    series = charts.timeline_series([tl])
    assert series["t_ms"][2] == pytest.approx(22.0) and series["mib"][2] == 180
    assert series["rss_mib"][3:5] == [490, None]
    assert [m[1] for m in series["marks"]["bwd"]] == ["root", "L1", "L0"]
    assert series["marks"]["gather"] == [(3.0, "all_gather_into_tensor 1024")]
    assert series["marks"]["all_reduce"] == [(4.0, "all_reduce 2048")]
    assert series["marks"]["optimizer"] == [(50.0, "optimizer")]


def _case(config, world, layers, times):
    return {
        "case": f"{config} w{world} L{layers}",
        "key": f"{config}-w{world}-l{layers}",
        "config": config,
        "world_size": world,
        "layers": layers,
        "impls": {impl: _impl(t, t, 0.0) for impl, t in times.items()},
    }


def test_scaling_data():
    results = {
        "cases": [
            _case("even", 2, 4, {"hyperfsdp": 0.3, "fsdp2": 0.35, "ddp": 0.25}),
            _case("even", 2, 8, {"hyperfsdp": 0.5, "fsdp2": 0.6, "ddp": 0.4}),
            _case("even", 2, 16, {"hyperfsdp": 0.9, "fsdp2": 1.0}),
            _case("even", 4, 8, {"hyperfsdp": 1.0, "fsdp2": 1.2}),
            _case("uneven", 2, 8, {"hyperfsdp": 9.0}),
        ]
    }
    results["cases"][2]["impls"]["ddp"] = {"status": "error: boom"}
    data = charts.scaling_data(results)
    layers = data["layers"]
    assert layers["x"] == [4, 8, 16] and layers["fixed"] == 2
    assert list(layers["impls"]) == ["hyperfsdp", "fsdp2", "ddp"]
    assert layers["impls"]["hyperfsdp"]["time"] == [0.3, 0.5, 0.9]
    assert layers["impls"]["ddp"]["time"] == [0.25, 0.4, None]
    assert layers["impls"]["fsdp2"]["rss"] == [610, 610, 610]
    assert layers["impls"]["fsdp2"]["heap"] == [300, 300, 300]
    assert data["world"]["x"] == [2, 4]
    assert charts.scaling_data({"cases": results["cases"][:1]}) == {}


def test_merge_results_later_wins():
    a = {"command": "a", "cases": [_case("even", 2, 4, {"hyperfsdp": 1.0})]}
    b = {
        "command": "b",
        "cases": [_case("even", 2, 4, {"hyperfsdp": 2.0}), _case("even", 2, 8, {})],
    }
    merged = suite.merge_results([a, b])
    assert [c["key"] for c in merged["cases"]] == ["even-w2-l4", "even-w2-l8"]
    assert merged["cases"][0]["impls"]["hyperfsdp"]["median_s"] == 2.0
    assert merged["merged_from"] == ["a", "b"]


def test_charts_are_drawn(tmp_path):
    # matplotlib comes with `make install` (hyperfsdp-bench[charts]): a missing one fails here
    case = _case("even", 2, 4, {"hyperfsdp": 0.3, "fsdp2": 0.35})
    case["timelines"] = {"hyperfsdp": [_timeline()], "fsdp2": [_timeline()]}
    results = {"cases": [case, _case("even", 2, 8, {"hyperfsdp": 0.5, "fsdp2": 0.6})]}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(results))
    paths = charts.draw_all(json.loads(path.read_text()), tmp_path / "out")
    assert sorted(p.name for p in paths) == ["scaling-layers.png", "timeline-even-w2-l4.png"]
    assert all(p.stat().st_size > 10_000 for p in paths)


def test_bf16_floor_computes_what_mixed_precision_does():
    """The bf16 floor: fp32 parameters cast into a bf16 copy before each forward, the copy's
    gradients cast back to fp32; equal bit for bit to doing those casts by hand."""
    import copy

    import torch
    from hyperfsdp_bench.impls import CaseSpec, build
    from hyperfsdp_bench.model import ModelConfig, build_model

    cfg = ModelConfig(vocab=64, dim=16, n_layers=2, n_heads=2, hidden=32, seq_len=8, batch=2)
    spec = CaseSpec(cfg, precision="bf16", seed=3)
    built = build("floor", spec)
    masters = list(built.state_model.parameters())
    assert all(p.dtype == torch.float32 for p in masters)
    assert all(p.dtype == torch.bfloat16 for p in built.model.parameters())

    ref = build_model(cfg, 3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=spec.lr, weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq_len), generator=gen)
        targets = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq_len), generator=gen)
        built.optimizer.zero_grad(set_to_none=True)
        loss = built.model(tokens, targets)
        loss.backward()
        assert all(p.grad is None for p in built.model.parameters())
        assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in masters)
        built.optimizer.step()

        low = copy.deepcopy(ref).to(torch.bfloat16)
        ref_loss = low(tokens, targets)
        ref_loss.backward()
        for full, p in zip(ref.parameters(), low.parameters(), strict=True):
            full.grad = p.grad.float()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        assert torch.equal(loss, ref_loss)
    for a, b in zip(masters, ref.parameters(), strict=True):
        assert torch.equal(a, b)


def rank_tensor_parallel_floor() -> tuple[int, list[tuple[float, float]], float]:
    """Three steps of the tensor-parallel floor beside this rank's own unsharded reference,
    trained on the same local batches; returns (data rank, losses, largest parameter gap)."""
    import torch
    import torch.distributed as dist
    from hyperfsdp_bench.impls import CaseSpec, build, data_rank, needs_process_group
    from hyperfsdp_bench.model import ModelConfig, build_model, make_batches
    from torch.distributed.tensor import DTensor

    cfg = ModelConfig(vocab=64, dim=16, n_layers=2, n_heads=2, hidden=32, seq_len=8, batch=2)
    spec = CaseSpec(cfg, tp=2, seed=3)
    assert needs_process_group("floor", spec) and not needs_process_group("floor", CaseSpec(cfg))
    built = build("floor", spec)
    assert all(isinstance(p, DTensor) for p in built.model.parameters())
    ref = build_model(cfg, spec.seed)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=spec.lr, weight_decay=0.1)
    dp_rank = data_rank(spec, dist.get_rank())
    losses = []
    for tokens, targets in make_batches(cfg, spec.seed, dp_rank, 3):
        built.optimizer.zero_grad(set_to_none=True)
        loss = built.model(tokens, targets)
        loss.backward()
        built.optimizer.step()
        ref_opt.zero_grad(set_to_none=True)
        ref_loss = ref(tokens, targets)
        ref_loss.backward()
        ref_opt.step()
        losses.append((float(loss.detach()), float(ref_loss.detach())))
    gap = max(
        (p.full_tensor() - r).abs().max().item()
        for p, r in zip(built.model.parameters(), ref.parameters(), strict=True)
    )
    return dp_rank, losses, gap


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_floor_trains_each_replica_on_its_own(run_ranks, world):
    """The floor of the TP cases is the TP model without FSDP: every data-parallel replica
    trains its local batch with no communication over dp, so each rank matches an unsharded
    model trained on that batch alone (fp32 tolerance), and replicas on different batches
    differ."""
    results = run_ranks(world, rank_tensor_parallel_floor, timeout=180)
    assert [r[0] for r in results] == [rank // 2 for rank in range(world)]
    for _, losses, gap in results:
        for ours, ref in losses:
            assert ours == pytest.approx(ref, rel=1e-5)
        assert gap < 1e-5
    if world == 4:
        assert results[0][1] != results[2][1]


def test_host_overhead_bound_skeleton_trains_like_the_floor():
    """``benchmarks/host_overhead_bound.py``'s skeleton (DTensor parameters swapped by hooks,
    DTensor gradients) is a working FSDP at world size 1: its losses, like hyperfsdp's and
    FSDP2's, equal the plain model's bit for bit (no timing is checked)."""
    import subprocess

    script = ROOT / "benchmarks" / "host_overhead_bound.py"
    out = subprocess.run(
        [sys.executable, str(script), "--steps", "3", "--warmup", "1", "--clock", "wall"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines()[2:]}
    assert sorted(rows) == ["floor", "fsdp2", "hyperfsdp", "skeleton"]
    assert all(rows[m][-1] == "True" for m in ("skeleton", "hyperfsdp", "fsdp2"))


def _bench_references(source: str) -> list[str]:
    """What in ``source`` reaches the benchmark suite: imports of ``hyperfsdp_bench`` (at
    any depth: lazy ones in functions and ``TYPE_CHECKING`` blocks too) and string
    constants naming it or the ``benchmarks`` folder (``import_module``, ``sys.path``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "hyperfsdp_bench"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == (
            "hyperfsdp_bench"
        ):
            found.append(node.module)
        elif isinstance(node, ast.Constant) and str(node.value).split(".")[0] in (
            "hyperfsdp_bench",
            "benchmarks",
        ):
            found.append(repr(node.value))
    return found


def test_core_never_imports_the_benchmark_suite():
    """The suite is its own distribution (``benchmarks/``, hyperfsdp-bench) that adds
    ``hyperfsdp bench`` through the plugin hook; nothing in hyperfsdp_core reaches it."""
    synthetic = "def f():\n    import hyperfsdp_bench.suite\n    return Path('x') / 'benchmarks'\n"
    assert _bench_references(synthetic) == ["hyperfsdp_bench.suite", "'benchmarks'"]
    assert _bench_references("from hyperfsdp_bench import names") == ["hyperfsdp_bench"]
    core = ROOT / "hyperfsdp_core"
    found = {
        str(path.relative_to(ROOT)): refs
        for path in sorted(core.rglob("*.py"))
        if (refs := _bench_references(path.read_text()))
    }
    assert found == {}


def test_copy_counter_counts_written_bytes():
    """``measure.copy_counter``: each copy op counts the bytes it writes (the destination of
    ``copy_`` and of ``out=``, else its output); other ops count nothing."""
    import torch
    from hyperfsdp_bench.measure import copy_counter

    a, b = torch.zeros(1000), torch.ones(1000)
    out = torch.empty(2000)
    with copy_counter() as counter:
        a.copy_(b[:500].repeat(2))  # repeat is no copy op; copy_ writes 4000 bytes
        torch.cat([a, b], out=out)  # 8000
        b.to(torch.float64)  # _to_copy: 8000
        torch.split_with_sizes_copy(out, [500, 1500], out=[torch.empty(500), torch.empty(1500)])
        a.add_(b)
    assert dict(counter.bytes) == {
        "aten::copy_": 4000,
        "aten::cat": 8000,
        "aten::_to_copy": 8000,
        "aten::split_with_sizes_copy": 8000,
    }
    assert dict(counter.calls) == {k: 1 for k in counter.bytes}


def rank_copies_and_allocations() -> dict:
    """One step of hyperfsdp on torch's own collectives and one of FSDP2 (a small even fp32
    model, every block and the root sharded), each counted by
    ``measure.count_copies_and_allocations``; returns both counts and the model's bytes."""
    import os

    from hyperfsdp_bench.impls import CaseSpec, build
    from hyperfsdp_bench.measure import count_copies_and_allocations
    from hyperfsdp_bench.model import ModelConfig, make_batches

    cfg = ModelConfig(vocab=64, dim=16, n_layers=2, n_heads=2, hidden=32, seq_len=8, batch=2)
    spec = CaseSpec(cfg, seed=3)
    out: dict = {}
    saved = os.environ.get("HYPERFSDP_GLOO_NATIVE_COLLECTIVES")
    try:
        for impl in ("hyperfsdp-native", "fsdp2"):
            built = build(impl, spec)
            batches = iter(make_batches(cfg, spec.seed, 0, 2))

            def step(built=built, batches=batches) -> None:
                tokens, targets = next(batches)
                built.optimizer.zero_grad(set_to_none=True)
                built.model(tokens, targets).backward()
                built.optimizer.step()

            step()  # the optimizer's state exists from here on
            out[impl] = count_copies_and_allocations(step)
    finally:
        if saved is None:
            os.environ.pop("HYPERFSDP_GLOO_NATIVE_COLLECTIVES", None)
        else:
            os.environ["HYPERFSDP_GLOO_NATIVE_COLLECTIVES"] = saved
    model = build("floor", spec).model
    blocks = sum(p.numel() * 4 for p in model.layers.parameters())
    out["bytes"] = (blocks, sum(p.numel() * 4 for p in model.parameters()) - blocks)
    return out


def test_bench_counts_copies_and_allocations_of_both_fsdps(run_ranks):
    """The suite's copy and allocation counts, by one method for both FSDPs (world 2, even
    fp32): FSDP2 copies every all-gather input in (``fsdp::all_gather_copy_in``: half the
    unsharded bytes of each gather: blocks twice, the root once) and hyperfsdp does not
    (its sharded storage is the input); both copy every gather out (the unsharded bytes)
    and pack every gradient once; the allocations of a step are counted."""
    for res in run_ranks(2, rank_copies_and_allocations, timeout=240):
        blocks, root = res["bytes"]
        ours, fsdp2 = res["hyperfsdp-native"], res["fsdp2"]
        gathered = 2 * blocks + root
        assert fsdp2["copy_bytes_by_op"]["fsdp::all_gather_copy_in"] == gathered // 2
        assert fsdp2["copy_bytes_by_op"]["fsdp::split_with_sizes_copy"] == gathered
        assert fsdp2["copy_bytes_by_op"]["fsdp::chunk_cat"] == blocks + root
        assert ours["copy_bytes_by_op"]["aten::split_with_sizes_copy"] == gathered
        assert ours["copy_bytes_by_op"]["aten::cat"] == blocks + root
        assert ours["copy_bytes"] == fsdp2["copy_bytes"] - gathered // 2
        for counts in (ours, fsdp2):
            assert counts["allocs"] > 0
            assert counts["alloc_bytes"] >= gathered  # every gather's unsharded buffer


def test_copies_table_reports_rss_growth_beside_fsdp2():
    """The memory table shows each rank's RSS growth over its start (the interpreter, torch
    and the process group left out) and its ratio to the reference's, beside peak RSS."""

    def copies(peak_rss, start, copied):
        return _impl(
            1.0,
            0.9,
            0.1,
            peak_rss_bytes=peak_rss,
            rss_at_start_bytes=start,
            copy_bytes_per_step=copied * MiB,
            copy_bytes_by_op_per_step={"aten::copy_": copied * MiB},
            allocs_per_step=100,
            alloc_bytes_per_step=10 * MiB,
        )

    res = {
        "case": "bf16 w2 L8",
        "config": "bf16",
        "world_size": 2,
        "layers": 8,
        "impls": {
            # rank 1 grows the most (330 MiB) though rank 0 has the higher peak
            "hyperfsdp": copies([560 * MiB, 550 * MiB], [270 * MiB, 220 * MiB], 40),
            "fsdp2": copies([630 * MiB, 590 * MiB], [270 * MiB, 270 * MiB], 80),
        },
    }
    suite._add_ratios(res)
    assert report.rss_growth(res["impls"]["hyperfsdp"]) == 330 * MiB
    assert report.rss_growth({"peak_rss_bytes": [600 * MiB]}) is None  # no start measured
    rows = {
        line.split()[3]: line.split()[4:]
        for line in report.copies_table({"cases": [res]}).splitlines()
        if line.startswith("bf16")
    }
    # after the case and impl: time x, peak RSS, RSS x, growth MiB, growth x, ...
    assert rows["hyperfsdp"][1:5] == ["560", "0.89x", "330", "0.92x"]
    assert rows["fsdp2"][1:5] == ["630", "1.00x", "360", "1.00x"]
