"""torchtitan 0.3.0's pipeline-parallel flow on a small Llama-like model, without torchtitan.

torchtitan is not a dependency (tests/test_torchtitan_pp.py, which runs its own helpers, skips
in CI); this file rebuilds, in a few lines each, the steps its ``pipeline_llm`` and trainer take
(torchtitan/distributed/pipeline_parallel.py, distributed/fsdp.py, trainer.py):

* the stage split: module names per stage from the layer count, the token embedding and the
  ``norm`` + ``lm_head`` pair each weighing one layer (``_generate_llm_fqn_per_model_part``
  with ``pipeline_parallel_first/last_stage_less_layers = 1``); one stage per pipeline rank
  for single-stage schedules, two for looped ones, stage ``r + k * pp`` on pipeline rank ``r``;
* each stage a deep copy of the whole (meta-device) model with what it does not own removed
  (other blocks deleted from ``layers``, ``tok_embeddings``/``norm``/``lm_head`` set to
  ``None``), its ``PipelineStage`` built before parallelization (``_pipeline_module_split``);
* FSDP per stage as ``apply_fsdp_to_decoder``: ``fully_shard`` on the embedding and on every
  block with ``reshard_after_forward=False`` (the "default" policy under PP), on
  ``[norm, lm_head]`` together (False too), then on the stage; FSDP's gradient division off
  (``set_gradient_divide_factor(1.0)`` on every ``FSDPModule``), then ``to_empty`` and a
  seeded in-place init of the sharded parameters;
* the schedule from ``get_schedule_class`` with ``scale_grads=False``, microbatch size 1, the
  loss a sum of token cross-entropies divided by the global count of valid (not ignored)
  tokens, passed as ``loss_kwargs``; gradient clipping whose norm is summed over the pipeline
  group (``dist_utils.clip_grad_norm_`` with ``pp_mesh``), AdamW.

World 4 on gloo, ``pp 2 x dp 2``. The flow runs once with torch's FSDP2 ``fully_shard`` and once
with ``hyperfsdp_core.fully_shard``: same losses, same final full parameters, same collectives
per step (one all-gather and one reduce-scatter per unit and step, not per microbatch).

Different from torchtitan: no rotary embedding, SDPA as the attention, FSDP2 reducing with
SUM (``set_force_sum_reduction_for_comms``: with the division off FSDP2 uses PREMUL_SUM,
which gloo lacks), no learning-rate schedule.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import schedules as _schedules

#: torchtitan's flow passes ``loss_kwargs`` to ``schedule.step`` (torch 2.13's schedules);
#: older schedules hand unknown keywords to the model, split into microbatches
needs_loss_kwargs = pytest.mark.skipif(
    "loss_kwargs" not in _schedules._PipelineSchedule._compute_loss.__code__.co_varnames,
    reason="this torch's pipeline schedules have no loss_kwargs, which torchtitan's flow uses",
)

VOCAB = 64
DIM = 16
HEADS = 2
HIDDEN = 32
LAYERS = 4
SEQ = 8
LOCAL_BATCH = 4  # sequences per data-parallel rank; microbatch size 1: 4 microbatches
STEPS = 3
IGNORE_INDEX = -100  # torchtitan's ignored label
PP = 2


# -- the model: a small Llama (torchtitan's Decoder layout: tok_embeddings, layers, norm, lm_head)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wk = nn.Linear(DIM, DIM, bias=False)
        self.wv = nn.Linear(DIM, DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (
            w(x).view(b, s, HEADS, DIM // HEADS).transpose(1, 2)
            for w in (self.wq, self.wk, self.wv)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, DIM))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(DIM, eps=1e-5)
        self.attention = Attention()
        self.ffn_norm = nn.RMSNorm(DIM, eps=1e-5)
        self.feed_forward = FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """``forward`` tolerates the parts a stage lacks (a stage's input is tokens or hidden
    states, its output hidden states or logits), as torchtitan's models do."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(LAYERS)})
        self.norm = nn.RMSNorm(DIM, eps=1e-5)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for block in self.layers.values():
            h = block(h)
        h = self.norm(h) if self.norm is not None else h
        return self.lm_head(h) if self.lm_head is not None else h

    @torch.no_grad()
    def init_weights(self) -> None:
        """In place, on the (sharded) parameters, as torchtitan's ``init_weights`` after
        ``to_empty``."""
        with warnings.catch_warnings():
            # on a CPU mesh each rank draws its shard from its own generator (seeded alike)
            warnings.filterwarnings("ignore", "DTensor random operators")
            self._init_parameters()

    def _init_parameters(self) -> None:
        for name, p in self.named_parameters():
            if "norm" in name:
                nn.init.ones_(p)
            else:
                nn.init.trunc_normal_(p, std=0.02 if "lm_head" not in name else DIM**-0.5)


# -- torchtitan's split, in its terms -------------------------------------------------------------


def names_per_stage(stages: int, layers: int, input_weight: int = 1, output_weight: int = 1):
    """Module names per stage: the embedding counts as ``input_weight`` layers of the first
    stage, ``norm`` + ``lm_head`` as ``output_weight`` layers of the last; the effective
    layers are spread evenly, the first stages taking the remainder."""
    effective = layers + input_weight + output_weight
    per, extra = divmod(effective, stages)
    out, next_layer = [], 0
    for s in range(stages):
        budget = per + (s < extra)
        names = []
        if s == 0:
            names.append("tok_embeddings")
            budget -= input_weight
        if s == stages - 1 and stages > 1:
            budget -= output_weight
        take = min(max(budget, 0), layers - next_layer)
        names += [f"layers.{i}" for i in range(next_layer, next_layer + take)]
        next_layer += take
        if s == stages - 1:
            names += ["norm", "lm_head"]
        out.append(names)
    return out


def stage_part(whole: nn.Module, names: list[str]) -> nn.Module:
    """A deep copy of ``whole`` keeping only ``names``: other blocks deleted from the
    ``layers`` dict (the kept ones under their original keys, so fully qualified names stay
    the whole model's), other top-level modules set to ``None``."""
    part = copy.deepcopy(whole)
    keep = set(names)
    for child_name, child in list(part.named_children()):
        if isinstance(child, nn.ModuleDict):
            for key in list(child.keys()):
                if f"{child_name}.{key}" not in keep:
                    del child[key]
        elif child_name not in keep:
            setattr(part, child_name, None)
    return part


def reshard_after_forward(policy: str, pp_enabled: bool) -> bool:
    # torchtitan's get_fsdp_reshard_after_forward_policy: under PP the default keeps the
    # parameters gathered across microbatches (no all-gather per microbatch)
    return {"always": True, "never": False, "default": not pp_enabled}[policy]


def apply_fsdp(part: Llama, fully_shard, mp_policy, mesh, policy: str = "default") -> None:
    raf = reshard_after_forward(policy, pp_enabled=True)
    config = {"mesh": mesh, "mp_policy": mp_policy}
    if part.tok_embeddings is not None:
        fully_shard(part.tok_embeddings, **config, reshard_after_forward=raf)
    if part.norm is not None and part.lm_head is not None:
        # the last units run last in forward and first in backward: never resharded in
        # between by default
        fully_shard([part.norm, part.lm_head], **config, reshard_after_forward=policy == "always")
    for block in part.layers.values():
        fully_shard(block, **config, reshard_after_forward=raf)
    fully_shard(part, **config)
    from torch.distributed.fsdp import FSDPModule  # torchtitan's check, torch's class

    for module in part.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # the loss divides by the global token count
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM


def units_with_params(part: Llama) -> int:
    return len(part.layers) + (part.tok_embeddings is not None) + (part.lm_head is not None)


class TorchCollectives:
    """FSDP2's collectives over the data-parallel group, counted where it calls
    torch.distributed (the schedule's point-to-point traffic is not counted)."""

    KINDS = {
        "all_gather_single": "ag",
        "all_gather_into_tensor": "ag",
        "reduce_scatter_single": "rs",
        "reduce_scatter_tensor": "rs",
        "all_reduce": "ar",
    }

    def __init__(self, group) -> None:
        self.group = group
        self.calls: list[str] = []
        self.saved: dict = {}

    def __enter__(self):
        for name, kind in self.KINDS.items():
            original = self.saved[name] = getattr(dist, name)

            def counted(*args, _fn=original, _kind=kind, **kwargs):
                if kwargs.get("group") is self.group:
                    self.calls.append(_kind)
                return _fn(*args, **kwargs)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def _batch(step: int, dp_rank: int, dp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (LOCAL_BATCH * dp_size, SEQ + 1), generator=gen)
    labels = tokens[:, 1:].clone()
    labels[::3, -2:] = IGNORE_INDEX  # some padding: the valid-token count is not the size
    rows = slice(dp_rank * LOCAL_BATCH, (dp_rank + 1) * LOCAL_BATCH)
    return tokens[rows, :-1], labels[rows]


def titan_flow(impl: str, schedule_name: str, fail_step: int | None = None):
    """``STEPS`` training steps of torchtitan's pipeline flow; returns the losses, the final
    full parameters of this rank's stages, the collectives per step, the number of units
    with parameters on this rank and the stage split."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

    if impl == "hyperfsdp":
        from hyperfsdp_core import MixedPrecisionPolicy, fully_shard
        from hyperfsdp_core.testing.counting import CollectiveCounter
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    # torchtitan's mesh order puts pp outermost: ranks 0, 1 hold stage 0 (and 2), ranks 2, 3
    # stage 1 (and 3)
    mesh = init_device_mesh("cpu", (PP, 2), mesh_dim_names=("pp", "fsdp"))
    dp_mesh, pp_group = mesh["fsdp"], mesh.get_group("pp")
    dp_rank, dp_size = dp_mesh.get_local_rank(), dp_mesh.size()
    pp_rank = mesh.get_local_rank("pp")

    cls = get_schedule_class(schedule_name)
    looped = issubclass(cls, PipelineScheduleMulti)
    n_stages = PP * (2 if looped else 1)
    split = names_per_stage(n_stages, LAYERS)
    stage_ids = [pp_rank + k * PP for k in range(n_stages // PP)]

    with torch.device("meta"):
        whole = Llama()
    parts = [stage_part(whole, split[i]) for i in stage_ids]
    stages = [
        PipelineStage(part, i, n_stages, torch.device("cpu"), group=pp_group)
        for part, i in zip(parts, stage_ids)
    ]
    mp_policy = MixedPrecisionPolicy(
        param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False
    )
    for part in parts:
        apply_fsdp(part, fully_shard, mp_policy, dp_mesh)
        part.to_empty(device="cpu")
        torch.manual_seed(0)
        part.init_weights()
        part.train()

    def loss_fn(pred, labels, global_valid_tokens):
        loss = F.cross_entropy(
            pred.flatten(0, 1).float(), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX
        )
        return loss / global_valid_tokens

    def make_schedule(stages):
        first = stages if looped else stages[0]
        return cls(first, n_microbatches=LOCAL_BATCH, loss_fn=loss_fn, scale_grads=False)

    schedule = make_schedule(stages)
    has_first = any(s.is_first for s in stages)
    has_last = any(s.is_last for s in stages)
    params = [p for part in parts for p in part.parameters()]
    opt = torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    calls = [0]
    # 1F1B: stage 0 runs F0 F1 B0 F2 ..., stage 1 F0 B0 F1 ...; stage 0 failing at its 3rd
    # forward and stage 1 at its 2nd leaves no rank waiting on a peer's send, with both
    # stages' units gathered and some gradient already accumulated
    fail_at = 3 if has_first else 2

    def failing(module, args):
        calls[0] += 1
        if calls[0] == fail_at:
            raise RuntimeError("microbatch failed")

    losses, counts = [], []
    for step in range(STEPS):
        tokens, labels = _batch(step, dp_rank, dp_size)
        valid = (labels != IGNORE_INDEX).sum()
        dist.all_reduce(valid, group=dp_mesh.get_group())  # torchtitan's dist_sum_tensor
        loss_kwargs = {"global_valid_tokens": valid}
        args = (tokens,) if has_first else ()
        target = labels if has_last else None
        if step == fail_step:
            hook = parts[0].register_forward_pre_hook(failing)
            with pytest.raises(RuntimeError) as failure:
                schedule.step(*args, target=target, losses=[], loss_kwargs=loss_kwargs)
            assert "microbatch failed" in repr(failure.value.__cause__ or failure.value)
            hook.remove()
            for part in parts:
                part.reset_iter_state()
            opt.zero_grad()
            # a pipeline stage cannot run again after a failed step: new stages and schedule
            # over the same parts
            stages = [
                PipelineStage(part, i, n_stages, torch.device("cpu"), group=pp_group)
                for part, i in zip(parts, stage_ids)
            ]
            schedule = make_schedule(stages)
        mb_losses: list[torch.Tensor] = []
        counter = (
            CollectiveCounter() if impl == "hyperfsdp" else TorchCollectives(dp_mesh.get_group())
        )
        with counter:
            schedule.step(
                *args,
                target=target,
                losses=mb_losses if has_last else None,
                loss_kwargs=loss_kwargs,
            )
        kinds = [c[0] if isinstance(c, tuple) else c for c in counter.calls]
        counts.append({k: kinds.count(k) for k in sorted(set(kinds))})
        # torchtitan's clip_grad_norm_ with pp_mesh: the DTensor norm made whole over the
        # data-parallel mesh, then its square summed over the pipeline group
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0, foreach=True)
        norm = norm.full_tensor() ** 2
        dist.all_reduce(norm, group=pp_group)
        torch.nn.utils.clip_grads_with_norm_(params, 1.0, norm.sqrt(), foreach=True)
        opt.step()
        opt.zero_grad()
        # the last stage's ranks hold this rank's share of the loss: summed over the world,
        # the global loss
        total = torch.stack(mb_losses).sum().detach() if has_last else torch.zeros(())
        dist.all_reduce(total)
        losses.append(total.item())
    full = {
        f"stage{i}.{name}": p.detach().full_tensor()
        for i, part in zip(stage_ids, parts)
        for name, p in part.named_parameters()
    }
    return losses, full, counts, sum(units_with_params(part) for part in parts), split


def _compare(ours, theirs, counts: bool = True, new_stages=(0,)) -> None:
    for rank, (o, t) in enumerate(zip(ours, theirs)):
        losses, params, step_counts, units, split = o
        t_losses, t_params, t_counts, _, t_split = t
        assert split == t_split
        # same arithmetic in the same order: bit-identical in practice; fp32 tolerance
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(t_losses), rtol=1e-6, atol=1e-7
        )
        assert params.keys() == t_params.keys()
        for key in params:
            torch.testing.assert_close(
                params[key],
                t_params[key],
                rtol=1e-6,
                atol=1e-7,
                msg=lambda m, k=key, r=rank: f"rank {r} {k}: {m}",
            )
        if not counts:
            continue
        assert step_counts == t_counts, (rank, step_counts, t_counts)
        # reshard_after_forward=False under PP and one reduction per step: each unit with
        # parameters all-gathers and reduce-scatters once per step, not once per microbatch.
        # A new stage's first step gathers twice: its shape inference runs the stage's
        # forward, after which the schedule reshards the stage's units
        for step, c in enumerate(step_counts):
            gathers = units * (2 if step in new_stages else 1)
            assert c == {"ag": gathers, "rs": units}, (rank, step, step_counts, units)
    assert len({tuple(o[0]) for o in ours}) == 1  # every rank reports the same global loss


def test_stage_split_matches_torchtitans():
    # torchtitan 0.3.0's _generate_llm_fqn_per_model_part(stages, 4, 1, 1)
    assert names_per_stage(2, 4) == [
        ["tok_embeddings", "layers.0", "layers.1"],
        ["layers.2", "layers.3", "norm", "lm_head"],
    ]
    assert names_per_stage(4, 4) == [
        ["tok_embeddings", "layers.0"],
        ["layers.1", "layers.2"],
        ["layers.3"],
        ["norm", "lm_head"],
    ]
    with torch.device("meta"):
        whole = Llama()
    part = stage_part(whole, ["layers.1", "layers.2"])
    assert part.tok_embeddings is None and part.norm is None and part.lm_head is None
    assert list(part.layers.keys()) == ["1", "2"]
    assert list(whole.layers.keys()) == ["0", "1", "2", "3"]


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B"])
@needs_loss_kwargs
def test_titan_pipeline_flow_like_fsdp2(run_ranks, schedule):
    """dp 2 x pp 2: one stage per rank (1F1B) or two (Interleaved1F1B: stages 0 and 2 on
    pipeline rank 0, the last holding only norm and lm_head)."""
    ours = run_ranks(4, titan_flow, "hyperfsdp", schedule)
    theirs = run_ranks(4, titan_flow, "fsdp2", schedule)
    _compare(ours, theirs)


@needs_loss_kwargs
def test_titan_pipeline_flow_recovers_from_a_failed_microbatch(run_ranks):
    """1F1B, the second step fails midway (units gathered, gradients partly accumulated);
    ``reset_iter_state()`` on each stage, gradients zeroed, new stages and schedule, the step
    again: FSDP2's run with the same failure (collectives included: the new stages infer
    shapes again), and FSDP2's run without the failure (losses and parameters)."""
    ours = run_ranks(4, titan_flow, "hyperfsdp", "1F1B", 1)
    theirs = run_ranks(4, titan_flow, "fsdp2", "1F1B", 1)
    _compare(ours, theirs, new_stages=(0, 1))
    clean = run_ranks(4, titan_flow, "fsdp2", "1F1B")
    _compare(ours, clean, counts=False)
