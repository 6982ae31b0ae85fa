"""Training loops beyond FSDP2 (issue 11): every backward drains, pipeline reduce entry,
torch.compile'd blocks, retained and create_graph graphs, evaluation at any point, frozen
parameters, reshard_after_forward=<int> registration, order of reduce-scatter and all-reduce.

Each case trains a sharded model on gloo ranks and an unsharded reference on the same global
batch; losses, gradients (``None`` exactly where the reference has ``None``) and parameters
are compared to fp32 tolerance.
"""

import copy
import math
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from hyperfsdp_core import fully_shard
from hyperfsdp_core.testing.reference import (
    RMSNorm,
    Transformer,
    assert_close_params,
    full,
    lm_loss,
    local_slice,
    token_batch,
)

VOCAB = 29
ATOL, RTOL = 1e-5, 1e-4


def build(**kw):
    torch.manual_seed(0)
    return Transformer(**{"vocab": VOCAB, "dim": 16, "n_layers": 2, "hidden": 20, **kw})


def shard(model, **kw):
    for block in model.layers:
        fully_shard(block, **kw)
    fully_shard(model)
    return model


def pair(**kw):
    model = build(**kw)
    return model, copy.deepcopy(model)


def optimizers(model, ref, lr=1e-2):
    return [torch.optim.AdamW(m.parameters(), lr=lr) for m in (model, ref)]


def step(opts):
    for opt in opts:
        opt.step()
        opt.zero_grad()


def sharded_params(model):
    """Every managed parameter's sharded DTensor by FQN (whatever is registered now)."""
    return {
        hp.fqn: hp.sharded_param
        for state in model._hyperfsdp_state.ctx.states
        if state.group is not None
        for hp in state.group.params
    }


def grads_of(ref):
    return {n: None if p.grad is None else p.grad.clone() for n, p in ref.named_parameters()}


def assert_grads(model, ref, what=""):
    """Full gradients equal the reference's (a module, or :func:`grads_of` one);
    ``None`` exactly where the reference's are."""
    ref_grads = ref if isinstance(ref, dict) else grads_of(ref)
    params = sharded_params(model)
    assert set(params) == set(ref_grads), what
    for name, p in params.items():
        want = ref_grads[name]
        if want is None:
            assert p.grad is None, f"{what}: {name} has a gradient, the reference has none"
            continue
        assert p.grad is not None, f"{what}: {name} has no gradient, the reference has one"
        torch.testing.assert_close(
            full(p.grad), want, atol=ATOL, rtol=RTOL, msg=lambda m, n=name: f"{what} {n}: {m}"
        )


def mean_over_ranks(loss):
    t = loss.detach().clone()
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def assert_loss(loss, ref_loss, what=""):
    got, want = mean_over_ranks(loss), ref_loss.item()
    assert math.isclose(got, want, rel_tol=RTOL * 10, abs_tol=ATOL * 10), (what, got, want)


def batch(seed, world=None):
    world = world or dist.get_world_size()
    return token_batch(seed, 2 * world, 5, VOCAB)


def backward_both(model, ref, i):
    """Forward and backward of batch ``i`` on both models; the losses must agree."""
    x, y = batch(i)
    loss = lm_loss(model(local_slice(x)), local_slice(y))
    loss.backward()
    ref_loss = lm_loss(ref(x), y)
    ref_loss.backward()
    assert_loss(loss, ref_loss, f"step {i}")
    return loss


# -- 1. every backward drains; tree-wide settings ----------------------------------------------------


def pipeline_microbatches():
    """Pipeline-style: all micro-batches' forwards, then their backwards, with
    is_last_backward set only for the last one (set on a non-root unit: tree-wide)."""
    model, ref = pair()
    shard(model)
    opts = optimizers(model, ref)
    ctx_flags = []
    for it in range(2):
        micro = [batch(10 * it + i) for i in range(3)]
        outs = [model(local_slice(x)) for x, _ in micro]
        ref_outs = [ref(x) for x, _ in micro]
        ctx = model._hyperfsdp_state.ctx
        for i, ((_, y), out, ref_out) in enumerate(zip(micro, outs, ref_outs)):
            last = i == len(micro) - 1
            model.layers[1].set_is_last_backward(last)  # any unit of the tree
            ctx_flags.append(ctx.is_last_backward)
            loss = lm_loss(out, local_slice(y))
            loss.backward()
            ref_loss = lm_loss(ref_out, y)
            ref_loss.backward()
            assert_loss(loss, ref_loss, f"iteration {it} micro {i}")
            # every backward applied its gradients, whatever is_last_backward says
            assert_grads(model, ref, f"iteration {it} micro {i}")
            assert all(s.training_state.value == "IDLE" for s in ctx.states)
            # is_last_backward=False keeps the forward order for the next backward's prefetch
            assert bool(ctx.post_forward_order) == (not last)
        step(opts)
        # the other tree-wide setting: set on a unit, consumed by the root's next forward
        model.layers[0].set_post_optim_event(torch.Event())
        ctx_flags.append(ctx.post_optim_event is not None)
    assert_close_params(model, ref, atol=ATOL, rtol=RTOL)
    model(local_slice(batch(0)[0]))
    ctx_flags.append(ctx.post_optim_event is None)
    return ctx_flags


@pytest.mark.parametrize("world", [2, 4])
def test_every_backward_drains_whatever_is_last_backward(run_ranks, world):
    for flags in run_ranks(world, pipeline_microbatches, timeout=120):
        assert flags == [False, False, True, True] * 2 + [True]


# -- 2. pipeline reduce entry -------------------------------------------------------------------------


def explicit_reduce():
    model, ref = pair()
    shard(model)
    opts = optimizers(model, ref)
    reductions_in_hook = []
    # a: micro-batches with gradient sync off (as FSDP2's pipeline stages run them), each
    #    reduced right after its backward by the schedule; a second call reduces nothing
    for i in range(2):
        model.set_requires_gradient_sync(False)
        x, y = batch(i)
        lm_loss(model(local_slice(x)), local_slice(y)).backward()
        assert_grads(model, ref, f"sync-off micro {i}: kept, not reduced yet")
        lm_loss(ref(x), y).backward()
        model.reduce_grads()
        assert_grads(model, ref, f"sync-off micro {i} reduced")
        model.reduce_grads()
        assert_grads(model, ref, f"sync-off micro {i} reduced twice")
        assert model._hyperfsdp_state.options.requires_gradient_sync is False  # setting restored
    model.set_requires_gradient_sync(True)
    step(opts)
    # b: called for a unit once its backward is done (a hook on its input's gradient),
    #    inside the root's backward: the root drain does not reduce it again
    unit = model.layers[1]

    def reduce_when_done(grad):
        reductions_in_hook.append(1)
        unit.reduce_grads(recurse=False)

    def hook_input(module, args):
        args[0].register_hook(reduce_when_done)

    for it in range(2):
        x, y = batch(10 + it)
        handle = unit.register_forward_pre_hook(hook_input)
        loss = lm_loss(model(local_slice(x)), local_slice(y))
        handle.remove()
        loss.backward()
        lm_loss(ref(x), y).backward()
        assert_grads(model, ref, f"reduced inside backward, iteration {it}")
        step(opts)
    assert_close_params(model, ref, atol=ATOL, rtol=RTOL)
    return len(reductions_in_hook)


@pytest.mark.parametrize("world", [2, 4])
def test_reduce_grads_for_pipeline_schedules(run_ranks, world):
    assert run_ranks(world, explicit_reduce, timeout=120) == [2] * world


# -- 3. torch.compile'd blocks --------------------------------------------------------------------------


def compiled_blocks(backend, steps):
    model, ref = pair()
    shard(model)
    for block in model.layers:  # as torchtitan does, after fully_shard
        block.compile(fullgraph=True, backend=backend)
    opts = optimizers(model, ref)
    losses = []
    for i in range(steps):
        loss = backward_both(model, ref, i)
        losses.append(mean_over_ranks(loss))
        step(opts)
    assert_close_params(model, ref, atol=ATOL, rtol=RTOL)
    return losses


def test_compiled_blocks_aot_eager(run_ranks):
    losses = run_ranks(2, compiled_blocks, "aot_eager", 3, timeout=180)
    assert losses[0] == losses[1] and losses[0][-1] < losses[0][0]


def test_compiled_blocks_inductor(run_ranks):
    losses = run_ranks(2, compiled_blocks, "inductor", 2, timeout=300)
    assert losses[0] == losses[1]


# -- 4. backward twice through one graph -------------------------------------------------------------


def two_losses_one_forward(reshard_after_forward):
    model, ref = pair()
    shard(model, reshard_after_forward=reshard_after_forward)
    opts = optimizers(model, ref)
    for i in range(2):
        x, y = batch(i)
        out, ref_out = model(local_slice(x)), ref(x)
        for j, (loss_fn, retain) in enumerate(
            [(lm_loss, True), (lambda o, t: o.float().pow(2).mean(), False)]
        ):
            loss, ref_loss = loss_fn(out, local_slice(y)), loss_fn(ref_out, y)
            loss.backward(retain_graph=retain)
            ref_loss.backward(retain_graph=retain)
            assert_loss(loss, ref_loss, f"step {i} loss {j}")
            assert_grads(model, ref, f"step {i} after backward {j}")
        step(opts)
    assert_close_params(model, ref, atol=ATOL, rtol=RTOL)
    return True


@pytest.mark.parametrize(("world", "reshard_after_forward"), [(2, True), (4, 2)])
def test_backward_twice_through_one_graph(run_ranks, world, reshard_after_forward):
    assert run_ranks(world, two_losses_one_forward, reshard_after_forward, timeout=120)


# -- 5. double backward (gradient penalty) -------------------------------------------------------------


class Critic(nn.Module):
    """A root unit with parameters (input and output layers) around sharded blocks."""

    def __init__(self, dim=12, hidden=10, n_blocks=2):
        super().__init__()
        self.inp = nn.Linear(6, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(RMSNorm(dim), nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, dim))
            for _ in range(n_blocks)
        )
        self.out = nn.Linear(dim, 1)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


def penalty_loss(model, x, with_output_term):
    """WGAN-GP style: the gradient of the output with respect to the input, penalised;
    with the output terms, one more forward before and one after the create_graph backward,
    else a forward under no_grad (a metric) before the penalty's backward."""
    x = x.clone().requires_grad_()
    real = model(x * 0.5) if with_output_term else None
    out = model(x)
    (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    penalty = (g.norm(dim=1) - 1).pow(2).mean()
    if not with_output_term:
        with torch.no_grad():
            model(x * 3.0)
        return penalty
    fake = model(x.detach() * 2.0)
    return fake.mean() - real.mean() + out.mean() + penalty


def gradient_penalty(with_output_term):
    torch.manual_seed(0)
    model = Critic()
    ref = copy.deepcopy(model)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opts = optimizers(model, ref)
    for i in range(3):
        g = torch.Generator().manual_seed(100 + i)
        x = torch.randn(2 * dist.get_world_size(), 6, generator=g)
        loss = penalty_loss(model, local_slice(x), with_output_term)
        ref_loss = penalty_loss(ref, x, with_output_term)
        assert_grads(model, ref, f"step {i} after the create_graph backward")  # all None
        ctx = model._hyperfsdp_state.ctx
        assert str(ctx.backward) == "graph_held"  # its graph saved the unsharded parameters
        loss.backward()
        assert str(ctx.backward) == "none"  # consumed
        ref_loss.backward()
        assert_loss(loss, ref_loss, f"step {i}")
        assert_grads(model, ref, f"step {i}")
        step(opts)
    assert_close_params(model, ref, atol=ATOL, rtol=RTOL)
    # differentiating through parameter gradients cannot be sharded: a clear error
    x = torch.randn(2, 6)
    try:
        model(x).pow(2).mean().backward(create_graph=True)
    except RuntimeError as exc:
        model.reset_iter_state()
        return str(exc)
    return "no error"


@pytest.mark.parametrize(("world", "with_output_term"), [(2, True), (4, True), (2, False)])
def test_double_backward_gradient_penalty(run_ranks, world, with_output_term):
    for message in run_ranks(world, gradient_penalty, with_output_term, timeout=120):
        assert "create_graph=True" in message and "parameter 'blocks.1." in message, message
        assert "torch.autograd.grad(out, inputs, create_graph=True)" in message


# -- 6. evaluation between backward and optimizer step -----------------------------------------------


def evaluate(model, ref, mode, seed):
    x, y = batch(seed)
    if mode == "eval":
        model.eval(), ref.eval()
        losses = lm_loss(model(local_slice(x)), local_slice(y)), lm_loss(ref(x), y)
        model.train(), ref.train()
    else:
        with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
            losses = lm_loss(model(local_slice(x)), local_slice(y)), lm_loss(ref(x), y)
    assert_loss(*losses, f"evaluation {seed}")


def evaluate_mid_step(mode, reshard_after_forward):
    model, ref = pair()
    shard(model, reshard_after_forward=reshard_after_forward)
    opts = optimizers(model, ref, lr=5e-2)
    evaluate(model, ref, mode, 99)  # before any training: the first forward (lazy init)
    for i in range(3):
        backward_both(model, ref, i)
        evaluate(model, ref, mode, 100 + i)  # between backward and optimizer step
        step(opts)
    x, y = batch(50)  # the next training forward must see the updated parameters
    assert_loss(lm_loss(model(local_slice(x)), local_slice(y)), lm_loss(ref(x), y), "after")
    assert_close_params(model, ref, atol=ATOL, rtol=RTOL)
    return True


@pytest.mark.parametrize(
    ("world", "mode", "reshard_after_forward"),
    [
        (2, "no_grad", True),
        (2, "inference_mode", True),
        (2, "eval", True),
        (4, "no_grad", 2),
        (4, "eval", 2),
    ],
)
def test_evaluation_between_backward_and_step(run_ranks, world, mode, reshard_after_forward):
    assert run_ranks(world, evaluate_mid_step, mode, reshard_after_forward, timeout=120)


# -- 7. frozen parameters anywhere ------------------------------------------------------------------


def frozen_anywhere():
    model, ref = pair()
    for m in (model, ref):
        m.tok_embeddings.weight.requires_grad_(False)  # in the root unit
        m.layers[0].requires_grad_(False)  # an all-frozen unit
        m.layers[1].attn_norm.weight.requires_grad_(False)  # mixed with trainable ones
    shard(model)
    opts = [
        torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
        for m in (model, ref)
    ]
    for i in range(3):
        backward_both(model, ref, i)
        assert_grads(model, ref, f"step {i}")
        step(opts)
    assert_close_params(model, ref, atol=ATOL, rtol=RTOL)
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_frozen_parameters_anywhere(run_ranks, world):
    assert run_ranks(world, frozen_anywhere, timeout=120)


# -- 8. reshard_after_forward=<int>: what is registered between forward and backward ------------------


def post_forward_registration():
    # blocks: one bucket of several members, hidden=27 uneven over 4 ranks and over the
    # groups of 2, wo sharded on dim 1; norm: one even member (gathered in place);
    # output: one uneven member (29 rows)
    model, ref = pair(hidden=27)
    for block in model.layers:
        fully_shard(
            block,
            reshard_after_forward=2,
            shard_placement_fn=lambda p: Shard(1) if p.shape == (16, 16) else None,
        )
    fully_shard(model.norm, reshard_after_forward=2)
    fully_shard(model.output, reshard_after_forward=2)
    fully_shard(model)
    opts = optimizers(model, ref)
    seen = []
    for i in range(2):
        x, y = batch(i)
        out = model(local_slice(x))
        ref_params = dict(ref.named_parameters())
        units = {"layers": model.layers, "norm": model.norm, "output": model.output}
        for name, p in [(n, p) for k, m in units.items() for n, p in m.named_parameters(k)]:
            assert isinstance(p, DTensor), name
            mesh = p.device_mesh
            dim = p.placements[1].dim
            assert mesh.ndim == 2 and tuple(mesh.mesh.shape) == (2, 2), (name, mesh)
            assert tuple(p.placements) == (Replicate(), Shard(dim)), (name, p.placements)
            want = ref_params[name].detach()
            chunk = want.chunk(2, dim=dim)
            index = mesh.get_local_rank(1)
            expected = chunk[index] if index < len(chunk) else want.narrow(dim, 0, 0)
            assert p.to_local().shape == expected.shape, (name, p.to_local().shape)
            torch.testing.assert_close(p.to_local(), expected)
            torch.testing.assert_close(p.full_tensor(), want)
            seen.append((name, dim, tuple(p.to_local().shape)))
        lm_loss(out, local_slice(y)).backward()
        lm_loss(ref(x), y).backward()
        assert_grads(model, ref, f"step {i}")
        step(opts)
    assert_close_params(model, ref, atol=ATOL, rtol=RTOL)
    return seen


def test_reshard_after_forward_int_registers_post_forward_dtensors(run_ranks):
    results = run_ranks(4, post_forward_registration, timeout=120)
    for rank, seen in enumerate(results):
        shapes = dict((name, shape) for name, _, shape in seen)
        # w1 (27, 16) over groups of 2: 14 rows on the first rank of a group, 13 on the second
        first = rank % 2 == 0  # groups of 2: ranks (0, 1), (2, 3)
        assert shapes["layers.0.mlp.w1.weight"] == ((14, 16) if first else (13, 16))
        assert shapes["layers.0.attn.wo.weight"] == (16, 8)  # Shard(1)
        assert shapes["norm.weight"] == (8,)
        assert shapes["output.weight"] == ((15, 16) if first else (14, 16))


# -- 9. order of reduce-scatters and data-parallel all-reduces ---------------------------------------


class _Logged:
    def __init__(self, work, log, entry):
        self._work, self._log, self._entry = work, log, entry

    def wait(self, *args):
        self._log.append(("wait", self._entry))
        return self._work.wait(*args) if self._work is not None else True


def hsdp_order():
    from hyperfsdp_core.comm import Comm

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model, ref = pair(n_layers=3)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opts = optimizers(model, ref)
    log = []
    # logged where the core issues them, whichever transport carries them (through shared
    # memory a reduce-scatter is done when issued: its handle holds no work)
    orig_rs, orig_ar = Comm.reduce_scatter, Comm.all_reduce

    def reduce_scatter(comm, out, inp, *args, **kw):
        entry = ("rs", out.data_ptr())
        log.append(("issue", entry))
        handle = orig_rs(comm, out, inp, *args, **kw)
        if handle.done:
            log.append(("wait", entry))
        else:
            handle._work = _Logged(handle._work, log, entry)
        return handle

    def all_reduce(comm, tensor, *args, **kw):
        log.append(("issue", ("ar", tensor.data_ptr())))
        return orig_ar(comm, tensor, *args, **kw)

    Comm.reduce_scatter, Comm.all_reduce = reduce_scatter, all_reduce
    try:
        for i in range(2):
            log.clear()
            x, y = batch(i)  # data-parallel rank = replicate rank * 2 + shard rank = rank
            lm_loss(model(local_slice(x)), local_slice(y)).backward()
            lm_loss(ref(x), y).backward()
            step(opts)
    finally:
        Comm.reduce_scatter, Comm.all_reduce = orig_rs, orig_ar
    assert_close_params(model, ref, atol=ATOL, rtol=RTOL)
    return log


def test_all_reduce_follows_own_and_next_reduce_scatter(run_ranks):
    for log in run_ranks(4, hsdp_order, timeout=120):
        issued = [e for kind, e in log if kind == "issue"]
        rs = [e for e in issued if e[0] == "rs"]
        assert len(rs) == 4  # the root and 3 blocks, in backward order
        for k, (_, ptr) in enumerate(rs):
            ar = ("ar", ptr)
            assert ar in issued, f"no all-reduce of reduce-scatter {k}"
            # after its own reduce-scatter completed ...
            assert log.index(("wait", rs[k])) < log.index(("issue", ar))
            # ... and after the next unit's reduce-scatter was issued
            if k + 1 < len(rs):
                assert log.index(("issue", rs[k + 1])) < log.index(("issue", ar))


# -- the new transitions, as logged (RFC 8.2) ---------------------------------------------------------


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.block(x))


def logged_transitions(case):
    model = Wrapper()
    fully_shard(model.block)
    fully_shard(model)
    x = torch.randn(2, 4, requires_grad=True)
    os.environ["HYPERFSDP_LOG_TRANSITIONS"] = "1"  # the rank resets its environment after
    out = model(x)
    log = model._hyperfsdp_state.ctx.transition_log
    if case == "retain_graph":
        out.sum().backward(retain_graph=True)
        out.pow(2).sum().backward()
    elif case == "create_graph":
        (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        (out.mean() + g.pow(2).sum()).backward()
    elif case == "reduce_grads_inside_backward":
        x.register_hook(lambda grad: model.block.reduce_grads())
        out.sum().backward()
    return [(event, old, new) for fqn, event, old, new in log if fqn == "block"]


FORWARD = [
    ("forward_pre", "IDLE", "PRE_FORWARD"),
    ("forward_post", "PRE_FORWARD", "FORWARD"),
]
ROOT_DRAIN = [
    ("root_backward_enter", "BACKWARD", "BACKWARD"),
    ("root_backward_exit", "BACKWARD", "BACKWARD"),
]
BACKWARD = [
    ("backward_pre", "FORWARD", "PRE_BACKWARD"),
    ("post_backward", "PRE_BACKWARD", "BACKWARD"),
    *ROOT_DRAIN,
]
AGAIN = [  # a further backward through the same graph, after the root drain
    ("backward_pre", "IDLE", "PRE_BACKWARD"),
    ("post_backward", "PRE_BACKWARD", "BACKWARD"),
]
GRAPH_DRAIN = [  # graph mode: the root drain reduces what the deferred post-backward left
    ROOT_DRAIN[0],
    ("post_backward", "BACKWARD", "BACKWARD"),
    ROOT_DRAIN[1],
]


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("retain_graph", FORWARD + BACKWARD + AGAIN + ROOT_DRAIN),
        (
            "create_graph",
            FORWARD + BACKWARD[:2] + GRAPH_DRAIN + AGAIN + GRAPH_DRAIN,
        ),
        # the unit's input-gradient hook (after its post-backward) reduces it again: what
        # arrived since, i.e. nothing; the root drain then leaves it alone
        (
            "reduce_grads_inside_backward",
            FORWARD + BACKWARD[:2] + [("post_backward", "BACKWARD", "BACKWARD")] + ROOT_DRAIN,
        ),
    ],
)
def test_new_transitions_are_logged(run_ranks, case, expected):
    for log in run_ranks(2, logged_transitions, case):
        assert log == expected, log
