"""What ``torch.distributed.pipelining`` sees of a hyperfsdp stage.

A pipeline schedule treats a stage as FSDP when its module is an instance of torch's
``FSDPModule`` (every hyperfsdp unit is one: ``module.fsdp_class``). It then drives the
stage through the public methods hyperfsdp shares with FSDP2:

- before each microbatch's backward: ``set_is_last_backward(False)``,
  ``set_reshard_after_backward(False)``, ``set_requires_gradient_sync(False)``: gradients
  accumulate unreduced on the unsharded parameters, which stay gathered for the next
  microbatch's backward (as FSDP2's);
- after metadata inference: ``reshard()`` and ``param.grad = None`` on every unit;
- UNSHARD/RESHARD actions of the runtime schedules: ``unshard(async_op=True)``,
  ``UnshardHandle.wait()``, ``reshard()``;
- once per step (``perform_reduce_grad``): the three setters back to ``True``, then
  ``fully_shard.state(stage)``, whose FSDP2 state it asks to post-backward each parameter
  group and to run the root's end-of-backward callback.

That last call is the only one reaching into FSDP2's state, so every unit exposes a
:class:`StageReduceView` as its "FSDP2 state" (``_torch_private.expose_fsdp2_state``): no
per-group post-backward, and the end-of-backward callback is
:meth:`FSDPModule.reduce_grads` on the stage: every gradient the stage's units hold is
reduced once for the step, over the whole data-parallel group, and the units are resharded.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .drain import reduce_grads


class StageReduceView:
    """The object ``torch.distributed.fsdp.fully_shard.state(unit)`` returns for a hyperfsdp
    unit; only torch's pipeline stage reads it (``perform_reduce_grad``)."""

    __slots__ = ("module",)

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    @property
    def _state_ctx(self) -> StageReduceView:
        return self

    @property
    def all_states(self) -> tuple[Any, ...]:
        # FSDP2's per-group post-backward: none; the whole stage is reduced at once below
        return ()

    def _root_post_backward_final_callback(self) -> None:
        state = self.module._hyperfsdp_state  # type: ignore[attr-defined]
        if state.is_root and state.ctx is not None:
            # a stage is a root: its tree's units, listed once at lazy init
            reduce_grads(state.ctx.states)
        else:
            self.module.reduce_grads()  # type: ignore[operator]

    def __repr__(self) -> str:
        return f"StageReduceView({type(self.module).__name__})"
