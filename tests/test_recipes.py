"""End-to-end recipes: chunked loss with a [norm, output] list unit, activation-checkpoint
wrappers, the common large-model recipe, and optimizers built at the wrong time."""

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.tensor import distribute_tensor
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from hyperfsdp_core import fully_shard
from hyperfsdp_core.testing.reference import (
    Transformer,
    assert_close_params,
    lm_loss,
    local_slice,
    token_batch,
    train_parity,
)

VOCAB, DIM, SEQ = 43, 16, 6


class Body(Transformer):
    """Returns the final-norm hidden states; the output head is applied by the loss."""

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.norm(h)


def chunked_loss(model, h, targets, n_chunks, sharded):
    """Cross-entropy over sequence chunks, one head call and one backward per chunk."""
    hd = h.detach().requires_grad_()
    total = 0.0
    head = model.output
    if sharded:
        head.unshard()
        head.set_reshard_after_backward(False, recurse=False)
    for i, (hc, yc) in enumerate(zip(hd.chunk(n_chunks, dim=1), targets.chunk(n_chunks, dim=1))):
        last = i == n_chunks - 1
        if sharded:
            head.set_requires_gradient_sync(last, recurse=False)
        loss = lm_loss(head(hc), yc) * (yc.shape[1] / targets.shape[1])
        loss.backward()
        total += loss.item()
    if sharded:
        head.set_reshard_after_backward(True, recurse=False)
        head.reshard()
    h.backward(hd.grad)
    return total


def large_model_recipe(n_chunks):
    torch.manual_seed(0)
    ref = Body(vocab=VOCAB, dim=DIM, n_layers=3, hidden=25)
    with torch.device("meta"):
        model = Body(vocab=VOCAB, dim=DIM, n_layers=3, hidden=25)
    fully_shard(model.tok_embeddings)
    for block in model.layers:
        fully_shard(block, reshard_after_forward=True)
    fully_shard([model.norm, model.output], reshard_after_forward=False)
    fully_shard(model)
    model.to_empty(device="cpu")
    ref_params = dict(ref.named_parameters())
    with torch.no_grad():  # in-place init of the sharded parameters
        for name, p in model.named_parameters():
            p.copy_(distribute_tensor(ref_params[name].detach(), p.device_mesh, p.placements))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    gaps = []
    for step in range(3):
        x, y = token_batch(step, 4, SEQ, VOCAB)
        loss = chunked_loss(model, model(local_slice(x)), local_slice(y), n_chunks, sharded=True)
        ref_loss = chunked_loss(ref, ref(x), y, 1, sharded=False)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        gaps.append(abs(norm.full_tensor().item() - ref_norm.item()))
        t = torch.tensor(loss)
        dist.all_reduce(t)
        gaps.append(abs(t.item() / dist.get_world_size() - ref_loss))
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    assert_close_params(model, ref)
    return max(gaps)


@pytest.mark.parametrize("n_chunks", [1, 3])
def test_large_model_recipe_with_chunked_loss(run_ranks, n_chunks):
    for gap in run_ranks(2, large_model_recipe, n_chunks):
        assert gap < 1e-5


class WrappedTransformer(Transformer):
    def __init__(self, kind, **kw):
        super().__init__(**kw)
        self.kind = kind
        if kind == "checkpoint_wrapper":
            self.layers = nn.ModuleList(checkpoint_wrapper(block) for block in self.layers)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            if self.kind == "selective":
                context = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
                h = checkpoint(layer, h, use_reentrant=False, context_fn=context)
            else:
                h = layer(h)
        return self.output(self.norm(h))


def _save_matmuls(ctx, op, *args, **kwargs):
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def wrapped_parity(kind):
    def shard(model):
        for block in model.layers:
            fully_shard(block)
        fully_shard(model)

    build = functools.partial(WrappedTransformer, kind, vocab=VOCAB, dim=DIM, n_layers=2, hidden=20)
    train_parity(build, shard, lambda s: token_batch(s, 4, SEQ, VOCAB), lm_loss, steps=3)
    torch.manual_seed(0)
    model = build()
    keys = list(model.state_dict())
    shard(model)
    assert list(model.state_dict()) == keys  # checkpoint_wrapper's key cleanup still applies
    return True


@pytest.mark.parametrize("kind", ["checkpoint_wrapper", "selective"])
def test_activation_checkpoint_wrappers(run_ranks, kind):
    assert run_ranks(2, wrapped_parity, kind) == [True, True]


def optimizer_too_early():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fully_shard(model)
    model(torch.randn(2, 4)).sum().backward()
    try:
        opt.step()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_optimizer_built_before_fully_shard_is_an_error(run_ranks):
    (message,) = run_ranks(1, optimizer_too_early)
    assert "'0.weight'" in message and "after fully_shard" in message


def optimizer_too_early_per_block(first: str):
    """The usual recipe (a unit per block, a [norm, output] list unit, the root), with the
    optimizer built before it; ``first``: the parameter the optimizer holds first."""
    torch.manual_seed(0)
    model = Transformer(vocab=VOCAB, dim=DIM, n_layers=2, n_heads=2, hidden=20)
    param = dict(model.named_parameters())[first]
    opt = torch.optim.SGD([param, *(p for p in model.parameters() if p is not param)], lr=0.1)
    for block in model.layers:
        fully_shard(block)
    fully_shard([model.norm, model.output])
    fully_shard(model)
    x, y = token_batch(0, 2 * dist.get_world_size(), SEQ, VOCAB)
    lm_loss(model(local_slice(x)), local_slice(y)).backward()
    try:
        opt.step()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize(
    "first", ["layers.0.attn.wqkv.weight", "layers.1.mlp.w2.weight", "output.weight", "norm.weight"]
)
def test_optimizer_error_names_the_fqn_from_the_root(run_ranks, first):
    # the block's own fully_shard knew "attn.wqkv.weight", the list unit "[1].weight": the
    # root's call names them from the model
    for message in run_ranks(2, optimizer_too_early_per_block, first):
        assert f"holds parameter {first!r} as it was before" in message


def post_optim_event():
    model = nn.Linear(4, 4)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        model.set_post_optim_event(torch.Event())  # CPU: nothing to wait on, accepted
    return model._hyperfsdp_state.ctx.post_optim_event is not None  # tree-wide: on the context


def test_set_post_optim_event_accepted_on_cpu(run_ranks):
    # the root consumes the event at its next forward; on CPU there is no stream to order
    assert run_ranks(1, post_optim_event) == [True]
