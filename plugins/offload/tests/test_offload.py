"""Offload plugin: parity with the single-process reference, where tensors live, phase order.

Most tests run with ``HYPERFSDP_OFFLOAD_SIMULATE_ASYNC=1``: the plugin then takes its
accelerator gradient path on these CPU ranks, with copies that complete only when the
plugin waits for them (reading NaN before), so a missing or misplaced wait fails parity.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.utils.parametrize as parametrize
from hyperfsdp_offload import plugin as offload_plugin
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from hyperfsdp_core import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from hyperfsdp_core.plugin import (
    FIRST_PHASE,
    Phase,
    build_plugin_manager,
    get_plugin_manager,
    hookimpl,
    unit_of,
)
from hyperfsdp_core.testing import registered
from hyperfsdp_core.testing.reference import (
    Transformer,
    assert_close_params,
    full,
    lm_loss,
    local_slice,
    token_batch,
)

VOCAB = 37
TIMEOUT = 120
OFFLOAD = CPUOffloadPolicy()  # pin_memory=True, FSDP2's default
MP = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)


def build() -> Transformer:
    torch.manual_seed(0)
    return Transformer(vocab=VOCAB, dim=16, n_layers=2, n_heads=2, hidden=27)


def mesh_for(shape):
    if len(shape) == 1:
        return init_device_mesh("cpu", shape)
    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))


def shard(model, mesh=None, mp=None, offload=OFFLOAD):
    kwargs = {"mesh": mesh, "offload_policy": offload}
    if mp is not None:
        kwargs["mp_policy"] = mp
    for block in model.layers:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def simulate(on: bool = True) -> None:
    os.environ[offload_plugin.SIMULATE_ENV] = "1" if on else ""


class _Cast(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, w):
        return w.to(self.dtype)


def compute_in(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The reference of a mixed-precision model: every parameter is cast to ``dtype`` on
    use (differentiably, so fp32 gradients reach the fp32 parameters)."""
    for sub in list(module.modules()):
        for name, p in list(sub.named_parameters(recurse=False)):
            if p.is_floating_point():
                parametrize.register_parametrization(sub, name, _Cast(dtype), unsafe=True)
    return module


def reference_params(ref: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters by their unparametrized FQN."""
    return {
        n.replace("parametrizations.", "").replace(".original", ""): p
        for n, p in ref.named_parameters()
    }


def where_everything_lives(model, opt) -> set[str]:
    """Device types of parameters, gradients and optimizer state (local tensors)."""
    tensors = [p.to_local() for p in model.parameters()]
    tensors += [p.grad.to_local() for p in model.parameters() if p.grad is not None]
    for state in opt.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                tensors.append(value.to_local() if isinstance(value, DTensor) else value)
    return {t.device.type for t in tensors}


# -- parity ------------------------------------------------------------------------------------------


def parity_case(shape, mixed: bool, simulated: bool) -> dict:
    simulate(simulated)
    mesh = mesh_for(shape)
    world = dist.get_world_size()
    mp = MP if mixed else None
    model, plain, ref = build(), build(), build()
    if mixed:
        compute_in(ref, torch.bfloat16)
    shard(model, mesh, mp)
    shard(plain, mesh, mp, offload=OffloadPolicy())  # the same sharding, no offload
    if mixed:  # SGD: parameter gaps track the bf16 gradient error (AdamW amplifies it)
        opts = [torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.5) for m in (model, plain, ref)]
    else:
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, plain, ref)]
    start = {n: full(p.detach()).clone() for n, p in model.named_parameters()}
    grads_on = set()
    for step in range(3):
        x, y = token_batch(step, 2 * world, 5, VOCAB)
        lm_loss(model(local_slice(x)), local_slice(y)).backward()
        lm_loss(plain(local_slice(x)), local_slice(y)).backward()
        lm_loss(ref(x), y).backward()
        grads_on |= {p.grad.to_local().device.type for p in model.parameters()}
        for opt in opts:
            opt.step()
        lives = where_everything_lives(model, opts[0])  # after step(), before zero_grad()
        for opt in opts:
            opt.zero_grad()
    # offload changes where tensors live, never a value: bitwise equal to no offload
    plain_params = dict(plain.named_parameters())
    differ = [
        n
        for n, p in model.named_parameters()
        if not torch.equal(p.to_local(), plain_params[n].to_local())
    ]
    refs = reference_params(ref)
    worst = max(
        (full(p.detach()) - refs[n].detach()).abs().max().item()
        for n, p in model.named_parameters()
    )
    moved = max((refs[n].detach() - start[n]).abs().max().item() for n in start)
    storage = {row.column("storage") for row in model.sharding_plan()}
    return {
        "differ": differ,
        "worst": worst,
        "moved": moved,
        "lives": lives,
        "grads_on": grads_on,
        "storage": storage,
        "optimizer_state": sum(len(s) for s in opts[0].state.values()),
    }


def rank_parity(cases):
    return {case: parity_case(*case) for case in cases}


PARITY = {
    2: [((2,), False, True), ((2,), True, True), ((2,), False, False)],
    4: [
        ((4,), False, True),
        ((4,), True, True),
        ((2, 2), False, True),
        ((2, 2), True, True),
        ((2, 2), True, False),
    ],
}


@pytest.mark.parametrize("world", sorted(PARITY))
def test_parity_with_the_reference(run_ranks, world):
    for results in run_ranks(world, rank_parity, PARITY[world], timeout=TIMEOUT):
        for (shape, mixed, simulated), r in results.items():
            case = f"mesh {shape}, mixed={mixed}, simulated={simulated}"
            assert r["differ"] == [], case
            assert r["lives"] == {"cpu"} and r["grads_on"] == {"cpu"}, case
            assert r["optimizer_state"] > 0, case
            assert r["storage"] == {"host"}, case  # CPU ranks: nothing to pin
            if mixed:  # bf16 compute and reduction against the fp32 reference
                assert r["moved"] > 0.1 and r["worst"] < 5e-3, (case, r)  # seen: 1.4e-3
            else:
                assert r["worst"] < 1e-5, (case, r)  # seen: 1.3e-7


# -- where the copy sits: after every data-parallel and tensor-parallel reduction -------------------


def grad_states(units) -> dict[str, str]:
    """Per parameter: ``none`` (not landed), ``pending`` (landed, copy in flight: the
    simulated copy reads NaN until it is waited for) or ``done``."""
    out = {}
    for unit in units:
        for p in unit.params:
            g = p.sharded_param.grad
            if g is None:
                out[p.fqn] = "none"
            else:
                out[p.fqn] = "pending" if torch.isnan(g.to_local()).all() else "done"
    return out


class HoldBlocks:
    """Stands in for the tp plugin: holds the reductions of the blocks (where tensor-parallel
    replicated norms would be) with ``Reduction.defer()`` until its ``tp.replicate_all_reduce``
    phase, logging gradient states around it; logs all-reduces and the phases run."""

    def __init__(self) -> None:
        self.held: list = []
        self.log: list[tuple] = []

    @hookimpl
    def hyperfsdp_gradient_reducers(self, unit):
        if not any("attn_norm" in p.fqn for p in unit.params):
            return None

        def hold(reductions):
            for red in reductions:
                red.defer()
                self.held.append(red)

        return hold

    def tp_phase(self, root) -> None:
        self.log.append(("held", grad_states(root.units)))
        held, self.held = self.held, []
        for red in held:
            red.release()
        self.log.append(("released", grad_states(root.units)))

    def probe(self, root) -> None:
        self.log.append(("after offload", grad_states(root.units)))

    @hookimpl
    def hyperfsdp_finalize_phases(self):
        return [
            Phase(TP_PHASE, self.tp_phase, after=FIRST_PHASE, after_if_present="dp.all_reduce"),
            Phase("zz.probe", self.probe, after=offload_plugin.PHASE),
        ]

    @hookimpl
    def hyperfsdp_collective_observer(self, root):
        return lambda event: self.log.append(("collective", event.kind, event.group_size))

    # the core's transition log (HYPERFSDP_LOG_TRANSITIONS=1), read through logging
    def emit(self, record: logging.LogRecord) -> None:
        _, event, old, _ = record.args
        if event == "phase":
            self.log.append(("phase", old))


TP_PHASE = "tp.replicate_all_reduce"


class _Relay(logging.Handler):
    def __init__(self, target) -> None:
        super().__init__()
        self.target = target

    def emit(self, record: logging.LogRecord) -> None:
        self.target.emit(record)


def rank_phase_order():
    simulate()
    os.environ["HYPERFSDP_LOG_TRANSITIONS"] = "1"
    pm = get_plugin_manager()
    real_tp = pm.get_plugin("tp")  # the real tp plugin declares the same phase
    if real_tp is not None:
        pm.unregister(real_tp)
    probe = HoldBlocks()
    transitions = logging.getLogger("hyperfsdp_core.transitions")
    relay = _Relay(probe)
    transitions.addHandler(relay)
    transitions.propagate = False
    try:
        with registered(probe, "test_hold_blocks"):
            declared = [p.name for p in pm.finalization_phases()]
            world = dist.get_world_size()
            model, ref = shard(build(), mesh_for((2, 2))), build()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
            logs = []
            for step in range(2):
                probe.log = []
                x, y = token_batch(step, 2 * world, 5, VOCAB)
                lm_loss(model(local_slice(x)), local_slice(y)).backward()
                lm_loss(ref(x), y).backward()
                refs = dict(ref.named_parameters())
                for n, p in model.named_parameters():
                    torch.testing.assert_close(full(p.grad), refs[n].grad, atol=1e-5, rtol=1e-4)
                logs.append(probe.log)
                opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
            assert_close_params(model, ref)
    finally:
        transitions.removeHandler(relay)
        transitions.propagate = True
        if real_tp is not None:
            pm.register(real_tp, name="tp")
    return declared, logs


def summary(states: dict[str, str]) -> dict[str, set[str]]:
    """Gradient states of the blocks' parameters (held) and of the root's."""
    out: dict[str, set[str]] = {"blocks": set(), "root": set()}
    for fqn, state in states.items():
        out["blocks" if fqn.startswith("layers.") else "root"].add(state)
    return out


def test_grads_land_after_every_reduction_and_the_phase_waits_for_the_copies(run_ranks):
    order = ["core.reduce_scatter_drain", "dp.all_reduce", TP_PHASE, offload_plugin.PHASE]
    for declared, logs in run_ranks(4, rank_phase_order, timeout=TIMEOUT):
        assert [n for n in declared if n in order] == order
        for log in logs:
            phases = [entry[1] for entry in log if entry[0] == "phase"]
            assert [n for n in phases if n in order] == order
            assert phases[-1] == "zz.probe"
            events = [e for e in log if e[0] != "collective" or e[1] == "all_reduce"]
            # every data-parallel all-reduce (replicate group of 2) is issued before the
            # device-to-host phase
            last_all_reduce = max(i for i, e in enumerate(events) if e[0] == "collective")
            assert last_all_reduce < events.index(("phase", offload_plugin.PHASE))
            probes = {
                e[0]: summary(e[1]) for e in log if e[0] in ("held", "released", "after offload")
            }
            # at the tp phase: the held gradients are still on the device (not landed);
            # the root's landed after dp.all_reduce and are being copied
            assert probes["held"] == {"blocks": {"none"}, "root": {"pending"}}
            # released: they land, and their copies start after the tp all-reduce
            assert probes["released"] == {"blocks": {"pending"}, "root": {"pending"}}
            # the offload phase waited for every copy
            assert probes["after offload"] == {"blocks": {"done"}, "root": {"done"}}


# -- gradient accumulation ----------------------------------------------------------------------------


def rank_accumulation(mode: str):
    simulate()
    world = dist.get_world_size()
    model, ref = shard(build()), build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    between = []
    for step in range(2):
        for micro in range(2):
            last = micro == 1
            if mode == "no_sync":
                model.set_requires_gradient_sync(last)
            else:
                model.set_is_last_backward(last)
            x, y = token_batch(10 * step + micro, 2 * world, 5, VOCAB)
            lm_loss(model(local_slice(x)), local_slice(y)).backward()
            lm_loss(ref(x), y).backward()
            if not last:
                between.append(summary(grad_states(unit_of(model).root.units)))
        refs = dict(ref.named_parameters())
        for n, p in model.named_parameters():
            assert p.grad.to_local().device.type == "cpu", n
            torch.testing.assert_close(full(p.grad), refs[n].grad, atol=1e-5, rtol=1e-4)
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    assert_close_params(model, ref)
    return between


@pytest.mark.parametrize("mode", ["no_sync", "not_last_backward"])
def test_gradient_accumulation(run_ranks, mode):
    for between in run_ranks(2, rank_accumulation, mode, timeout=TIMEOUT):
        if mode == "no_sync":
            # nothing is reduced or copied while sync is off: the unsharded gradients
            # accumulate on the compute device
            assert between == [{"blocks": {"none"}, "root": {"none"}}] * 2
        else:
            # every backward drains: all gradients are reduced and landed, their copies in
            # flight (the offload phase waits only before the optimizer step, after the last
            # backward); the next landing waits for them before the host adds into them
            assert between == [{"blocks": {"pending"}, "root": {"pending"}}] * 2


# -- state dicts and checkpoints --------------------------------------------------------------------


def host_dtensors(state) -> bool:
    """Every tensor in ``state`` is on the host; every parameter-shaped one is a DTensor."""
    values = [v for v in state.values() if isinstance(v, torch.Tensor)]
    sharded = [v for v in values if v.dim() > 0]
    return (
        bool(sharded)
        and all(isinstance(v, DTensor) for v in sharded)
        and {(v.to_local() if isinstance(v, DTensor) else v).device.type for v in values} == {"cpu"}
    )


def rank_state_dict(path: str):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    simulate()
    world = dist.get_world_size()
    model, ref = shard(build()), build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)

    def step(i, train_ref=True):
        x, y = token_batch(i, 2 * world, 5, VOCAB)
        lm_loss(model(local_slice(x)), local_slice(y)).backward()
        opt.step(), opt.zero_grad()
        if train_ref:
            lm_loss(ref(x), y).backward()
            ref_opt.step(), ref_opt.zero_grad()

    step(0)
    # plain state_dict(): host DTensors, round trip
    plain = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert host_dtensors(model.state_dict())
    # torch.distributed.checkpoint: model and optimizer
    msd, osd = get_state_dict(model, opt)
    opt_states = [s for s in osd["state"].values()]
    assert host_dtensors(msd) and all(host_dtensors(s) for s in opt_states)
    # no_dist: each rank writes and reads its own shards (DCP's coordinated planning
    # gathers Python objects, which needs NumPy; the test environment has none)
    path = f"{path}/rank{dist.get_rank()}"
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path, no_dist=True)
    saved = {k: full(v).clone() for k, v in msd.items()}
    saved_opt = {k: full(v["exp_avg"]).clone() for k, v in osd["state"].items()}

    step(1, train_ref=False)  # moves the model away from the checkpoint
    model.load_state_dict(plain)
    after_plain = {k: full(v) for k, v in model.state_dict().items()}
    assert all(torch.equal(after_plain[k], full(v)) for k, v in plain.items())
    step(1, train_ref=False)

    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path, no_dist=True)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    msd, osd = get_state_dict(model, opt)
    for k, v in msd.items():
        assert torch.equal(full(v), saved[k]), k
    for k, v in osd["state"].items():
        assert torch.equal(full(v["exp_avg"]), saved_opt[k]), k
    locals_ = [p.to_local() for p in model.parameters()]
    # loading rebuilt the storage where the plugin places it
    assert {t.device.type for t in locals_} == {"cpu"}
    assert {row.column("storage") for row in model.sharding_plan()} == {"host"}
    for i in (1, 2):  # training resumes exactly where the reference is
        step(i)
    assert_close_params(model, ref)
    assert where_everything_lives(model, opt) == {"cpu"}
    return sorted(msd)


def test_state_dict_and_dcp_round_trip_as_host_tensors(run_ranks, tmp_path):
    keys = run_ranks(2, rank_state_dict, str(tmp_path / "ckpt"), timeout=TIMEOUT)
    assert keys[0] == keys[1] and "layers.0.attn.wqkv.weight" in keys[0]


# -- meta-device init -----------------------------------------------------------------------------


def rank_meta_init():
    simulate()
    world = dist.get_world_size()
    with torch.device("meta"):
        model = Transformer(vocab=VOCAB, dim=16, n_layers=2, n_heads=2, hidden=27)
    shard(model)
    on_meta = all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    torch.manual_seed(1)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                module.reset_parameters()
            elif hasattr(module, "weight") and "Norm" in type(module).__name__:
                module.weight.fill_(1.0)
    ref = build()
    ref.load_state_dict({k: full(v) for k, v in model.state_dict().items()})
    devices = {p.to_local().device.type for p in model.parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(2):
        x, y = token_batch(step, 2 * world, 5, VOCAB)
        lm_loss(model(local_slice(x)), local_slice(y)).backward()
        lm_loss(ref(x), y).backward()
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    assert_close_params(model, ref)
    storage = {row.column("storage") for row in model.sharding_plan()}
    return on_meta, devices, storage, where_everything_lives(model, opt)


def test_meta_device_init(run_ranks):
    for on_meta, devices, storage, lives in run_ranks(2, rank_meta_init, timeout=TIMEOUT):
        assert on_meta and devices == {"cpu"} and lives == {"cpu"}
        assert storage == {"host"}


# -- pinning on a CPU-only host; the plugin missing -------------------------------------------------


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def rank_pin_notice():
    handler = _Records()
    logger = logging.getLogger("hyperfsdp_offload")
    logger.addHandler(handler)
    try:
        offload_plugin._pin_notice_logged = False  # as in a fresh process
        pinned = shard(build())  # three units, pin_memory=True
        shard(build())
        asked = list(handler.messages)
        offload_plugin._pin_notice_logged = False
        handler.messages.clear()
        shard(build(), offload=CPUOffloadPolicy(pin_memory=False))
        not_asked = list(handler.messages)
    finally:
        logger.removeHandler(handler)
    is_pinned = {p.to_local().is_pinned() for p in pinned.parameters()}
    return asked, not_asked, is_pinned


def test_pin_memory_is_skipped_with_one_log_line_per_process(run_ranks):
    for asked, not_asked, is_pinned in run_ranks(2, rank_pin_notice, timeout=TIMEOUT):
        assert len(asked) == 1 and "pinning is skipped" in asked[0] and "'cpu'" in asked[0]
        assert not_asked == []
        assert is_pinned == {False}


def rank_without_the_plugin():
    pm = get_plugin_manager()
    assert pm.get_plugin("offload") is offload_plugin  # found through its entry point
    assert build_plugin_manager(autoload=False).get_plugin("offload") is None
    pm.unregister(offload_plugin)
    try:
        linear = nn.Linear(4, 4)
        with pytest.raises(ImportError) as info:
            fully_shard(linear, offload_policy=CPUOffloadPolicy())
        untouched = not isinstance(linear, FSDPModule)
    finally:
        pm.register(offload_plugin, name="offload")
    fully_shard(nn.Linear(4, 4), offload_policy=CPUOffloadPolicy())  # with it: accepted
    return str(info.value), untouched


def test_cpu_offload_policy_without_the_plugin_names_the_extra(run_ranks):
    for message, untouched in run_ranks(2, rank_without_the_plugin, timeout=TIMEOUT):
        assert "pip install hyperfsdp[offload]" in message and untouched


def parity_on_a_simulated_accelerator(shape, mixed: bool) -> tuple[dict, list[str], set]:
    """``parity_case`` with the core on the accelerator code path (streams and events,
    ``hyperfsdp_core.testing.streams``): the host-to-device copies that fill the
    all-gather input run on the all-gather stream, after the optimizer step that wrote
    the host storage (the simulator runs the host's optimizer on the current stream)."""
    from hyperfsdp_core.testing.streams import simulated_accelerator

    with simulated_accelerator() as sim:
        result = parity_case(shape, mixed, True)
        streams = {stream for _, name, stream, _ in sim.collectives if "allgather" in name}
    return result, sim.violations, streams


@pytest.mark.parametrize("shape, mixed", [((2,), False), ((2,), True)], ids=["fp32", "bf16"])
def test_offload_streams_are_ordered_on_a_simulated_accelerator(run_ranks, shape, mixed):
    for r, violations, streams in run_ranks(
        2, parity_on_a_simulated_accelerator, shape, mixed, timeout=TIMEOUT
    ):
        assert violations == []
        assert streams == {"all_gather"}
        assert r["differ"] == [] and r["lives"] == {"cpu"}
        if mixed:
            assert r["moved"] > 0.1 and r["worst"] < 5e-3, r
        else:
            assert r["worst"] < 1e-5, r
