"""Drop-in where users reach fully_shard through other tools: torch's own policy objects are
accepted with their meaning, and ``use_as_fsdp2()`` points torch's public FSDP2 names at
hyperfsdp's for frameworks that import torch's (accelerate, Lightning: see
``test_accelerate.py`` and ``test_lightning.py`` for the real frameworks)."""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp

import hyperfsdp_core
from hyperfsdp_core import fully_shard, use_as_fsdp2
from hyperfsdp_core.testing.reference import Transformer, full, lm_loss, local_slice, token_batch

TORCH_FSDP2 = {name: getattr(torch_fsdp, name) for name in torch_fsdp.__all__}

# -- torch's policy objects ---------------------------------------------------------------------


def _train(policies: dict, steps: int = 3):
    """Shard a small transformer per block and at the root with ``policies`` (fully_shard
    keyword arguments), train it with AdamW; the losses, full parameters and the units."""
    torch.manual_seed(0)
    model = Transformer(vocab=37, dim=16, n_layers=2, n_heads=2, hidden=21)
    for block in model.layers:
        fully_shard(block, **policies)
    fully_shard(model, **policies)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        x, y = token_batch(step, 2 * dist.get_world_size(), 6, 37)
        loss = lm_loss(model(local_slice(x)), local_slice(y))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {n: full(p.detach()) for n, p in model.named_parameters()}
    return losses, params, model


def _same_training(ours: dict, theirs: dict) -> dict:
    """Train with hyperfsdp's policy objects and with torch's; bit-for-bit equality and
    what each unit was given (as hyperfsdp's records)."""
    losses_a, params_a, model_a = _train(ours)
    losses_b, params_b, model_b = _train(theirs)
    assert losses_a == losses_b
    for name, p in params_a.items():
        assert torch.equal(p, params_b[name]), name
    state_a, state_b = model_a._hyperfsdp_state, model_b._hyperfsdp_state
    return {
        "mp": (state_a.options.mp_policy, state_b.options.mp_policy),
        "offload": (state_a.options.offload_policy, state_b.options.offload_policy),
        "storage": (state_a.group.storage is not None, state_b.group.storage is not None),
        "dtypes": (
            {hp.param_dtype for hp in state_a.group.params},
            {hp.param_dtype for hp in state_b.group.params},
        ),
    }


def mixed_precision_policy():
    kwargs = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    got = _same_training(
        {"mp_policy": hyperfsdp_core.MixedPrecisionPolicy(**kwargs)},
        {"mp_policy": TORCH_FSDP2["MixedPrecisionPolicy"](**kwargs)},
    )
    assert got["mp"][0] == got["mp"][1] == hyperfsdp_core.MixedPrecisionPolicy(**kwargs)
    assert got["dtypes"] == ({torch.bfloat16}, {torch.bfloat16})
    return True


def offload_policy():
    got = _same_training({}, {"offload_policy": TORCH_FSDP2["OffloadPolicy"]()})
    assert got["offload"] == (hyperfsdp_core.OffloadPolicy(), hyperfsdp_core.OffloadPolicy())
    assert got["storage"] == (False, False)
    return True


def cpu_offload_policy():
    import os

    os.environ["HYPERFSDP_OFFLOAD_SIMULATE_ASYNC"] = "1"  # the plugin's accelerator path
    got = _same_training(
        {"offload_policy": hyperfsdp_core.CPUOffloadPolicy(pin_memory=False)},
        {"offload_policy": TORCH_FSDP2["CPUOffloadPolicy"](pin_memory=False)},
    )
    expected = hyperfsdp_core.CPUOffloadPolicy(pin_memory=False)
    assert got["offload"] == (expected, expected)
    assert got["storage"] == (True, True)  # the offload plugin placed the sharded storage
    return True


def policies_in_one_call():
    got = _same_training(
        {
            "mp_policy": hyperfsdp_core.MixedPrecisionPolicy(param_dtype=torch.bfloat16),
            "offload_policy": hyperfsdp_core.CPUOffloadPolicy(),
        },
        {
            "mp_policy": TORCH_FSDP2["MixedPrecisionPolicy"](param_dtype=torch.bfloat16),
            "offload_policy": TORCH_FSDP2["CPUOffloadPolicy"](),
        },
    )
    assert got["offload"][1] == hyperfsdp_core.CPUOffloadPolicy(pin_memory=True)
    assert got["dtypes"][1] == {torch.bfloat16} and got["storage"] == (True, True)
    return True


CASES = {
    "MixedPrecisionPolicy": mixed_precision_policy,
    "OffloadPolicy": offload_policy,
    "CPUOffloadPolicy": cpu_offload_policy,
    "both": policies_in_one_call,
}


def run_case(name):
    return CASES[name]()


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", sorted(CASES))
def test_torch_policy_objects_behave_as_hyperfsdps(run_ranks, name, world):
    assert run_ranks(world, run_case, name) == [True] * world


def offload_plugin_missing(how: str):
    """torch's and hyperfsdp's CPUOffloadPolicy without the offload plugin: the same error,
    which says that the plugin is missing, why, and what to install or pass."""
    import os

    from hyperfsdp_core.plugin.manager import reset_plugin_manager

    if how == "autoload_off":
        os.environ["HYPERFSDP_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    else:
        os.environ["HYPERFSDP_PLUGINS_DISABLE"] = "offload"
    reset_plugin_manager()
    messages = []
    for policy in (TORCH_FSDP2["CPUOffloadPolicy"](), hyperfsdp_core.CPUOffloadPolicy()):
        try:
            fully_shard(torch.nn.Linear(2, 2), offload_policy=policy)
        except ImportError as exc:
            messages.append(str(exc))
    # torch's OffloadPolicy() means no offload: no plugin needed
    fully_shard(torch.nn.Linear(2, 2), offload_policy=TORCH_FSDP2["OffloadPolicy"]())
    return messages


@pytest.mark.parametrize("how", ["autoload_off", "disabled"])
def test_cpu_offload_without_the_plugin_says_so(run_ranks, how):
    for messages in run_ranks(2, offload_plugin_missing, how):
        assert len(messages) == 2 and messages[0] == messages[1]
        message = messages[0]
        assert "needs the offload plugin" in message
        assert "pip install hyperfsdp[offload]" in message
        assert "OffloadPolicy()" in message
        if how == "disabled":
            assert "HYPERFSDP_PLUGINS_DISABLE: offload" in message
        else:
            assert "autoload is off" in message


def unknown_offload_policy():
    import attrs

    @attrs.frozen
    class DiskOffloadPolicy(hyperfsdp_core.OffloadPolicy):
        """A third-party plugin's policy, with that plugin not installed."""

    try:
        fully_shard(torch.nn.Linear(2, 2), offload_policy=DiskOffloadPolicy())
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_an_offload_policy_no_plugin_handles_is_named(run_ranks):
    (message,) = run_ranks(1, unknown_offload_policy)
    assert "DiskOffloadPolicy" in message and "no loaded plugin places sharded storage" in message


def dp_mesh_dims_without_tp_plugin():
    import os

    from torch.distributed.device_mesh import init_device_mesh

    from hyperfsdp_core.plugin.manager import reset_plugin_manager

    os.environ["HYPERFSDP_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    reset_plugin_manager()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    messages = []
    for dims in (TORCH_FSDP2["DataParallelMeshDims"], hyperfsdp_core.DataParallelMeshDims):
        try:
            fully_shard(torch.nn.Linear(2, 2), mesh=mesh, dp_mesh_dims=dims(shard="dp"))
        except ImportError as exc:
            messages.append(str(exc))
    return messages


#: torch's FSDP2 has DataParallelMeshDims from torch 2.13
needs_torch_dp_mesh_dims = pytest.mark.skipif(
    "DataParallelMeshDims" not in TORCH_FSDP2,
    reason="this torch's FSDP2 has no DataParallelMeshDims",
)


@needs_torch_dp_mesh_dims
def test_torch_data_parallel_mesh_dims_is_accepted(run_ranks):
    for messages in run_ranks(2, dp_mesh_dims_without_tp_plugin):
        assert len(messages) == 2 and messages[0] == messages[1]
        assert "pip install hyperfsdp[tp]" in messages[0]


def test_policy_conversion_keeps_every_field():
    from hyperfsdp_core.policies import as_dp_mesh_dims, as_mp_policy, as_offload_policy

    theirs = TORCH_FSDP2["MixedPrecisionPolicy"](
        param_dtype=torch.float16,
        reduce_dtype=torch.float32,
        output_dtype=torch.bfloat16,
        cast_forward_inputs=False,
    )
    assert as_mp_policy(theirs) == hyperfsdp_core.MixedPrecisionPolicy(
        torch.float16, torch.float32, torch.bfloat16, False
    )
    assert as_mp_policy(None) == hyperfsdp_core.MixedPrecisionPolicy()
    assert as_offload_policy(None) == hyperfsdp_core.OffloadPolicy()
    assert as_offload_policy(
        TORCH_FSDP2["CPUOffloadPolicy"](pin_memory=False)
    ) == hyperfsdp_core.CPUOffloadPolicy(pin_memory=False)
    assert type(as_offload_policy(TORCH_FSDP2["OffloadPolicy"]())) is hyperfsdp_core.OffloadPolicy
    if "DataParallelMeshDims" in TORCH_FSDP2:  # torch 2.13 and later
        theirs = TORCH_FSDP2["DataParallelMeshDims"](shard=("a", "b"), replicate="r")
        dims = as_dp_mesh_dims(theirs)
        assert dims == hyperfsdp_core.DataParallelMeshDims(shard=("a", "b"), replicate="r")
    mine = hyperfsdp_core.CPUOffloadPolicy()
    assert as_offload_policy(mine) is mine


@pytest.mark.parametrize(
    ("argument", "value"),
    [("mp_policy", "bf16"), ("offload_policy", True), ("dp_mesh_dims", ("dp",))],
)
def test_a_policy_of_another_type_is_a_type_error(argument, value):
    with pytest.raises(TypeError, match=rf"fully_shard\({argument}=\.\.\.\) expects .*torch"):
        fully_shard(torch.nn.Linear(2, 2), **{argument: value})


# -- use_as_fsdp2 -------------------------------------------------------------------------------

NAMESPACES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")
OURS = {
    "fully_shard": hyperfsdp_core.fully_shard,
    "FSDPModule": hyperfsdp_core.FSDPModule,
    "UnshardHandle": hyperfsdp_core.UnshardHandle,
    "register_fsdp_forward_method": hyperfsdp_core.register_fsdp_forward_method,
    "share_comm_ctx": hyperfsdp_core.share_comm_ctx,
    "MixedPrecisionPolicy": hyperfsdp_core.MixedPrecisionPolicy,
    "OffloadPolicy": hyperfsdp_core.OffloadPolicy,
    "CPUOffloadPolicy": hyperfsdp_core.CPUOffloadPolicy,
    "DataParallelMeshDims": hyperfsdp_core.DataParallelMeshDims,
}


def _names(module_name: str) -> dict:
    module = importlib.import_module(module_name)
    return {name: getattr(module, name) for name in OURS if hasattr(module, name)}


def test_every_public_fsdp2_name_is_switched():
    from torch.distributed.fsdp import _fully_shard  # the package that defines torch's FSDP2

    # every name torch's FSDP2 has (torch 2.11 lacks DataParallelMeshDims)
    assert set(_fully_shard.__all__) == set(OURS) & set(TORCH_FSDP2)
    assert set(_fully_shard.__all__) <= set(torch_fsdp.__all__)


def test_switch_points_torch_names_at_hyperfsdp_and_restores():
    before = {ns: _names(ns) for ns in NAMESPACES}
    assert all(
        before["torch.distributed.fsdp"][n] is TORCH_FSDP2[n]
        for n in before["torch.distributed.fsdp"]
    )
    switch = use_as_fsdp2()
    try:
        assert switch.active
        for ns in NAMESPACES:
            now = _names(ns)
            assert now and all(now[n] is OURS[n] for n in now), ns
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # at call time

        assert fully_shard is hyperfsdp_core.fully_shard
        assert MixedPrecisionPolicy is hyperfsdp_core.MixedPrecisionPolicy
        # torch's FSDP1 names are untouched
        assert torch_fsdp.FullyShardedDataParallel is TORCH_FSDP2["FullyShardedDataParallel"]
    finally:
        switch.restore()
    assert not switch.active
    for ns in NAMESPACES:
        assert all(v is before[ns][n] for n, v in _names(ns).items()), ns
    switch.restore()  # idempotent
    assert _names("torch.distributed.fsdp")["fully_shard"] is TORCH_FSDP2["fully_shard"]


def test_switch_as_a_context_manager_and_nested_in_any_order():
    with use_as_fsdp2() as outer:
        assert torch_fsdp.fully_shard is hyperfsdp_core.fully_shard
        inner = use_as_fsdp2()
        outer.restore()  # the outer one first: the inner one keeps the switch on
        assert torch_fsdp.FSDPModule is hyperfsdp_core.FSDPModule
        inner.restore()
        assert torch_fsdp.FSDPModule is TORCH_FSDP2["FSDPModule"]
    assert torch_fsdp.fully_shard is TORCH_FSDP2["fully_shard"]
    with pytest.raises(KeyError), use_as_fsdp2():
        raise KeyError("restored on the way out")
    assert torch_fsdp.fully_shard is TORCH_FSDP2["fully_shard"]


def test_code_imported_under_the_switch_binds_hyperfsdp(tmp_path, monkeypatch):
    """A framework module that binds torch's names at import (as torchtitan's
    ``torchtitan.distributed.fsdp`` does) gets hyperfsdp's when imported under the switch;
    torch's own pipelining keeps torch's (the switch imports it first)."""
    (tmp_path / "binds_at_import.py").write_text(
        textwrap.dedent(
            """
            from torch.distributed.fsdp import FSDPModule, fully_shard
            from torch.distributed._composable.fsdp import fully_shard as old_path
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with use_as_fsdp2():
        module = importlib.import_module("binds_at_import")
        import torch.distributed.pipelining.stage as stage
    try:
        assert module.fully_shard is module.old_path is hyperfsdp_core.fully_shard
        assert module.FSDPModule is hyperfsdp_core.FSDPModule
        assert stage.fully_shard is TORCH_FSDP2["fully_shard"]
        assert stage.FSDPModule is TORCH_FSDP2["FSDPModule"]
    finally:
        sys.modules.pop("binds_at_import", None)


def framework_prepare(model):
    """What a framework does: torch's names imported when it runs, torch's policy objects."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    for block in model.layers:
        fully_shard(block, mp_policy=MixedPrecisionPolicy(), offload_policy=OffloadPolicy())
    fully_shard(model, offload_policy=OffloadPolicy())
    assert isinstance(model, FSDPModule)
    return model


def switched_framework_training():
    """A framework's sharding under the switch is hyperfsdp's and trains as hyperfsdp does
    when called directly; after restoring, the same code gets torch's FSDP2 again."""
    with use_as_fsdp2():
        torch.manual_seed(0)
        switched = framework_prepare(
            Transformer(vocab=37, dim=16, n_layers=2, n_heads=2, hidden=21)
        )
    direct_losses, direct_params, _ = _train({})
    opt = torch.optim.AdamW(switched.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        x, y = token_batch(step, 2 * dist.get_world_size(), 6, 37)
        loss = lm_loss(switched(local_slice(x)), local_slice(y))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses == direct_losses
    for name, p in switched.named_parameters():
        assert torch.equal(full(p.detach()), direct_params[name]), name
    units = [m for m in switched.modules() if hasattr(m, "_hyperfsdp_state")]
    torch.manual_seed(0)
    plain = framework_prepare(Transformer(vocab=37, dim=16, n_layers=2, n_heads=2, hidden=21))
    return len(units), any(hasattr(m, "_hyperfsdp_state") for m in plain.modules())


@pytest.mark.parametrize("world", [2, 4])
def test_framework_code_shards_with_hyperfsdp_under_the_switch(run_ranks, world):
    assert run_ranks(world, switched_framework_training) == [(3, False)] * world
