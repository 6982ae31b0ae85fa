"""``hyperfsdp ckpt inspect`` and ``hyperfsdp ckpt export`` on a manager directory."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from dcp_testlib import trained
from hyperfsdp_dcp import CheckpointManager, export_checkpoint

from hyperfsdp_core.cli import main
from hyperfsdp_core.testing.reference import full


def make_checkpoints(root):
    model, opt, _, _ = trained("tied", 1)  # tied embedding/head: both keys are exported
    manager = CheckpointManager(root, model=model, optimizer=opt)
    manager.save(2)
    manager.save(4)
    manager.close()
    if dist.get_rank() == 0:  # what a killed save leaves
        os.mkdir(os.path.join(root, ".step-6.partial"))
    dist.barrier()
    return {k: full(v).clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from hyperfsdp_core.testing import run_on_ranks

    root = tmp_path_factory.mktemp("cli") / "run"
    expected = run_on_ranks(2, make_checkpoints, str(root))[0]
    return root, expected


def test_inspect_lists_tensors_chunks_and_steps(ckpt):
    root, _ = ckpt
    # through the installed entry point: the plugin adds the command to `hyperfsdp`
    out = subprocess.run(
        [sys.executable, "-m", "hyperfsdp_core", "ckpt", "inspect", str(root)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert f"checkpoint: {root / 'step-4'}" in out
    assert "step 4, saved by 2 ranks" in out
    assert "steps present: 2, 4" in out
    assert "ignored: .step-6.partial (unfinished save (partial))" in out
    # tok_embeddings (23, 8) over 2 ranks: 12 + 11 rows, one chunk written by each rank
    line = next(ln for ln in out.splitlines() if ln.startswith("model.tok_embeddings.weight "))
    assert line.split() == ["model.tok_embeddings.weight", "23x8", "float32", "r0:1", "r1:1", "736"]
    assert "optim.state.layers.0.attn.wqkv.weight.exp_avg" in out
    assert "other items:" in out and "trainer.step" in out


def test_inspect_json(ckpt, capsys):
    root, expected = ckpt
    assert main(["ckpt", "inspect", str(root), "--step", "2", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["trainer"] == {"step": 2, "world_size": 2, "format": 1}
    assert info["steps"] == [2, 4]
    tensors = {t["key"]: t for t in info["tensors"]}
    for key, value in expected.items():
        t = tensors[f"model.{key}"]
        assert tuple(t["shape"]) == tuple(value.shape) and t["dtype"] == "float32"
        assert sum(t["chunk_numels"]) == value.numel()  # no padding stored
        assert t["bytes"] == value.numel() * 4
    assert tensors["model.layers.0.attn_norm.weight"]["chunks_per_rank"] == {"0": 1, "1": 1}
    assert main(["ckpt", "inspect", str(root / "nothing-here")]) == 1
    assert "neither a DCP checkpoint" in capsys.readouterr().err


def _exported(path, fmt):
    if fmt == "safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    return torch.load(path, weights_only=True)


def test_export_full_state_dict_with_progress(ckpt, tmp_path, capsys):
    root, expected = ckpt
    out = tmp_path / "model.bin"
    assert main(["ckpt", "export", str(root), str(out)]) == 0
    captured = capsys.readouterr()
    fmt = "safetensors" if _has_safetensors() else "torch"
    assert f"wrote {len(expected)} tensors to {out} ({fmt})" in captured.out
    assert "export step-4" in captured.err and "100%" in captured.err  # the tqdm bar
    state = _exported(out, fmt)
    assert state.keys() == expected.keys()  # model keys, both names of the tied weight
    for key, value in expected.items():
        assert torch.equal(state[key], value), key
    # an unsharded model loads it directly
    from dcp_testlib import build

    model = build("tied", seed=9)
    model.load_state_dict(state)
    assert torch.equal(model.output.weight, expected["output.weight"])


def _has_safetensors():
    try:
        import safetensors  # noqa: F401
    except ImportError:
        return False
    return True


def test_export_without_safetensors_falls_back_to_torch_save(ckpt, tmp_path, monkeypatch, capsys):
    root, expected = ckpt
    monkeypatch.setitem(sys.modules, "safetensors", None)  # as if it were not installed
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    out = tmp_path / "model.pt"
    assert main(["ckpt", "export", str(root), str(out), "--step", "2", "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert "(torch)" in captured.out and "%" not in captured.err
    state = torch.load(out, weights_only=True)
    assert state.keys() == expected.keys()
    assert main(["ckpt", "export", str(root), str(tmp_path / "x"), "--format", "safetensors"]) == 1
    assert "pip install hyperfsdp-dcp[safetensors]" in capsys.readouterr().err


def test_export_everything_and_explicit_formats(ckpt, tmp_path):
    root, expected = ckpt
    out, fmt, n = export_checkpoint(
        root, tmp_path / "all.pt", prefix="", fmt="torch", progress=False
    )
    state = torch.load(out, weights_only=True)
    assert fmt == "torch" and n == len(state)
    assert {k.split(".", 1)[0] for k in state} == {"model", "optim"}
    assert torch.equal(state["model.norm.weight"], expected["norm.weight"])
    if _has_safetensors():
        out, fmt, _ = export_checkpoint(root, tmp_path / "m.safetensors", fmt="safetensors")
        assert fmt == "safetensors" and _exported(out, fmt).keys() == expected.keys()
    with pytest.raises(ValueError, match="no tensors under 'nope'"):
        export_checkpoint(root, tmp_path / "n.pt", prefix="nope", fmt="torch")
