"""FSDPModule: the mixin unioned into a sharded module's class, and the class union itself."""

from __future__ import annotations

import copyreg
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ._torch_private import torch_fsdp_module_class

if TYPE_CHECKING:
    from .engine.state import UnitState


class UnshardHandle:
    """A handle to wait on an :meth:`FSDPModule.unshard` issued with ``async_op=True``."""

    def __init__(self, state: UnitState | None = None) -> None:
        self._state = state

    def wait(self) -> None:
        """Wait for the all-gather; the unsharded parameters are then registered."""
        state, self._state = self._state, None
        if state is not None and state.group is not None:
            state.group.wait_for_unshard(state.comm)
            state.group.hold()


class FSDPModule:
    """Methods every sharded module gains (same meaning as PyTorch FSDP2's ``FSDPModule``)."""

    def __new__(cls, *args: Any, **kwargs: Any):
        # Containers (e.g. nn.Sequential slicing) build new instances of type(self):
        # build the original class instead of an unsharded "FSDP" module.
        orig = cls._hyperfsdp_orig_cls  # type: ignore[attr-defined]
        self = orig.__new__(orig, *args, **kwargs)
        self.__init__(*args, **kwargs)
        return self

    def __deepcopy__(self, memo: dict) -> Any:
        raise RuntimeError(
            "hyperfsdp: a sharded module cannot be deep-copied; copy its state_dict() into a "
            "freshly built module instead"
        )

    def _fsdp_state(self) -> UnitState:
        return self._hyperfsdp_state  # type: ignore[attr-defined]

    def _fsdp_states(self, recurse: bool) -> list[UnitState]:
        if not recurse:
            return [self._fsdp_state()]
        states: list[UnitState] = []
        for module in self.modules():  # type: ignore[attr-defined]
            state = getattr(module, "_hyperfsdp_state", None)
            if state is not None and state not in states:
                states.append(state)
        return states

    # -- unshard / reshard --------------------------------------------------------------------
    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters (not recursive); see FSDP2."""
        state = self._fsdp_state()
        group = state.group
        if group is None:
            return UnshardHandle() if async_op else None
        state.ensure_storage()
        if state.comm is None:
            from .comm import Comm

            state.use_comm(Comm(state.device, provisional=True))  # lazy init replaces it
        group.init_unsharded()
        group.unshard(state.comm)
        handle = UnshardHandle(state)
        if async_op:
            return handle
        handle.wait()
        group.hold()
        return None

    def reshard(self) -> None:
        """Free the unsharded parameters and register the sharded ones (not recursive)."""
        group = self._fsdp_state().group
        if group is not None:
            group.reshard()

    def reset_iter_state(self) -> None:
        """Recover after an exception in forward or backward; call on the root."""
        self._fsdp_state().reset_iter_state()

    def reduce_grads(self, *, recurse: bool = True) -> None:
        """Reduce this unit's gradients now (and its sub-units' with ``recurse``); hyperfsdp only.

        The entry for pipeline schedules (RFC 8.2), like FSDP2's stage-level
        post-backward: call it for a unit whose backward finished outside the root's
        backward, or after micro-batches run with ``set_requires_gradient_sync(False)``.
        Whatever gradient sync is set to, everything the units hold (gradients on the
        unsharded parameters, sync-off accumulations) is reduce-scattered and
        all-reduced over the whole data-parallel group, and the sharded parameters'
        ``.grad`` hold the result when it returns; parameters are resharded per
        ``set_reshard_after_backward``. Idempotent with the root's end-of-backward drain:
        inside a backward, the drain does not reduce these units again; after it, or
        called twice, nothing is reduced twice. Collective: call it on every rank.
        """
        from .engine.drain import reduce_grads

        reduce_grads(self._fsdp_states(recurse))

    # -- options ----------------------------------------------------------------------------------
    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the last before the optimizer step (the whole tree).

        Every backward still ends with every gradient reduced and applied and every unit
        back to IDLE; ``False`` only keeps the forward order that backward prefetching
        follows for the next backward (pipeline schedules: several forwards, then their
        backwards).
        """
        self._fsdp_state().set_tree_setting("is_last_backward", is_last_backward)

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        for state in self._fsdp_states(recurse):
            state.set_options(
                requires_gradient_sync=requires_gradient_sync,
                requires_all_reduce=requires_gradient_sync,
            )

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        for state in self._fsdp_states(recurse):
            state.set_options(requires_all_reduce=requires_all_reduce)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward must be a bool, got {reshard_after_forward!r}")
        for state in self._fsdp_states(recurse):
            state.set_options(
                reshard_after_forward=reshard_after_forward, auto_reshard_after_forward=False
            )

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        for state in self._fsdp_states(recurse):
            state.set_options(reshard_after_backward=reshard_after_backward)

    def set_modules_to_forward_prefetch(self, modules: Sequence[FSDPModule]) -> None:
        _check_fsdp_modules(modules)
        self._fsdp_state().set_options(forward_prefetch=tuple(m._fsdp_state() for m in modules))

    def set_modules_to_backward_prefetch(self, modules: Sequence[FSDPModule]) -> None:
        _check_fsdp_modules(modules)
        self._fsdp_state().set_options(backward_prefetch=tuple(m._fsdp_state() for m in modules))

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide reduced gradients by ``factor`` instead of the data-parallel size.

        Works on every backend: the collectives are plain SUMs, then the reduce-scatter
        output is divided by ``factor`` (the all-reduce of HSDP parameters only sums).
        """
        if factor <= 0:
            raise ValueError(f"gradient divide factor must be positive, got {factor}")
        self._set_group_option("divide_factor", float(factor))

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated FSDP2 spelling of :meth:`set_gradient_divide_factor`."""
        self.set_gradient_divide_factor(factor)

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        for state in self._fsdp_states(recurse):
            state.set_options(reduce_scatter_unused_params=reduce_scatter_unused_params)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        self._fsdp_state().set_options(unshard_in_backward=unshard_in_backward)

    def set_post_optim_event(self, event: torch.Event) -> None:
        """Make the root's next all-gathers wait on ``event`` instead of the whole stream
        (the whole tree, whichever unit it is called on)."""
        self._fsdp_state().set_tree_setting("post_optim_event", event)

    def set_all_reduce_hook(self, hook, *, stream=None) -> None:
        """Call ``hook(reduce_output)`` on each reduced gradient before it is applied.

        ``reduce_output`` is this rank's flat reduce-scatter output (pure FSDP) or the
        all-reduce output (HSDP); the hook may modify it in place (e.g. all-reduce it
        over a custom group). It runs on the current stream once the reduction is
        complete. ``stream`` is accepted for FSDP2 compatibility and not used; as in
        FSDP2, passing one is an error on a unit with replicated (HSDP) parameters, whose
        hook runs where their all-reduce runs.
        """
        group = self._fsdp_state().group
        if stream is not None and group is not None:
            replicated = [p.fqn for p in group.params if p.mesh_info.kind != "FSDP"]
            if replicated:
                raise ValueError(
                    "set_all_reduce_hook: stream cannot be set on a unit with replicated "
                    f"(HSDP) parameters ({', '.join(replicated)}): their hook runs where "
                    "their all-reduce runs. Call it without stream="
                )
        self._set_group_option("all_reduce_hook", hook)

    def set_custom_all_gather(self, comm) -> None:
        """Use an FSDP2-style ``AllGather`` object (``allocate`` + ``__call__``) for this unit."""
        self._set_group_option("custom_all_gather", comm)

    def set_custom_reduce_scatter(self, comm) -> None:
        """Use an FSDP2-style ``ReduceScatter`` object (``allocate`` + ``__call__``) for this unit."""
        self._set_group_option("custom_reduce_scatter", comm)

    def set_separate_reduce_scatter_group(
        self, enable: bool = True, *, recurse: bool = True
    ) -> None:
        """Run reduce-scatters on their own process group over the shard ranks.

        Collective on first use: call it on every rank in the same order. On CPU the
        separate group has its own gloo threads, so a reduce-scatter does not queue
        behind the next all-gather.
        """
        for state in self._fsdp_states(recurse):
            if state.group is not None:
                state.group.configure(separate_reduce_group=enable)

    def set_reduce_scatter_max_input_buffers(
        self, max_input_buffers: int, *, recurse: bool = True
    ) -> None:
        """How many reduce-scatters may be in flight before post-backward waits on the oldest."""
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be >= 1, got {max_input_buffers}")
        for state in self._fsdp_states(recurse):
            state.set_options(max_reduce_buffers=max_input_buffers)

    def _set_group_option(self, name: str, value) -> None:
        group = self._fsdp_state().group
        if group is not None:
            group.configure(**{name: value})

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Accepted for FSDP2 compatibility; it has no effect here.

        FSDP2 reduces with ``AVG`` or a pre-multiplied sum unless this is set, then with
        ``SUM`` and a separate division. hyperfsdp always does the latter: every
        reduce-scatter and all-reduce uses ``ReduceOp.SUM``, and the results are divided
        where FSDP2's ``AVG`` would divide (bit for bit FSDP2's on gloo by default). Under
        HSDP with this flag set, FSDP2 divides once after the all-reduce, so the last bits
        can differ (docs/design.md).
        """
        if not isinstance(enable, bool):
            raise TypeError(f"set_force_sum_reduction_for_comms expects a bool, got {enable!r}")

    def sharding_plan(self):
        """One row per managed parameter of this unit and its sub-units: a
        ``ShardingPlan`` of ``PlanRow`` records (``plugin/sharding_plan.py``; ``str()``
        prints a table)."""
        from .plugin.sharding_plan import sharding_plan

        return sharding_plan(self)

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        # Parameters must be the sharded ones while their data is converted, then the
        # padded communication storage is rebuilt around the converted shards.
        state = self._fsdp_state()
        if state.group is not None:
            state.group.reshard()
        result = super()._apply(*args, **kwargs)  # type: ignore[misc]
        if state.group is not None:
            if len(state.modules) == 1:
                state.reset_sharded_params()
            else:  # rebuild once every module of the list unit is converted
                state.reset_before_forward()
        return result


def _check_fsdp_modules(modules: Sequence[Any]) -> None:
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise ValueError(
                f"expected FSDPModule instances (modules given to fully_shard), got {type(m).__name__}"
            )


# ---------------------------------------------------------------------------------------------
# class union: type(module) becomes FSDP<Name>(FSDPModule, *mixins, Name), cached
# ---------------------------------------------------------------------------------------------

_CLASS_CACHE: dict[tuple[type, tuple[type, ...]], type] = {}

# torch's FSDP2 FSDPModule, last in the bases (after nn.Module, so it supplies no behaviour
# that hyperfsdp, a mixin or the original class defines): torch.distributed.pipelining and
# torchtitan recognise FSDP stages by isinstance (see _pipelining.py)
_TORCH_FSDP_MODULE = torch_fsdp_module_class()
_RECOGNISED_AS: tuple[type, ...] = (_TORCH_FSDP_MODULE,) if _TORCH_FSDP_MODULE else ()
_METACLASSES: dict[type, type] = {}


def fsdp_class(orig: type, mixins: tuple[type, ...] = ()) -> type:
    """The unioned class for ``orig`` (the same object every time for the same inputs).

    Unioned classes pickle by value of their recipe: unpickling (in any process) calls
    ``fsdp_class(orig, mixins)`` again with the original class and the plugin mixins,
    both pickled by reference, so ``torch.save(model)`` and multiprocessing work.
    """
    if issubclass(orig, FSDPModule):
        return orig
    key = (orig, tuple(mixins))
    cls = _CLASS_CACHE.get(key)
    if cls is None:
        name = "FSDP" + orig.__name__ + "".join("_" + m.__name__ for m in mixins)
        bases = (FSDPModule, *mixins, orig, *_RECOGNISED_AS)
        meta = _unioned_metaclass(bases)
        cls = meta(name, bases, {"_hyperfsdp_orig_cls": orig, "_hyperfsdp_mixins": tuple(mixins)})
        cls.__module__ = orig.__module__
        cls.__qualname__ = "FSDP" + orig.__qualname__ if not mixins else name
        # setdefault: thread-ranks (torch's threaded process group) may race here
        cls = _CLASS_CACHE.setdefault(key, cls)
    return cls


def _unioned_metaclass(bases: tuple[type, ...]) -> type:
    """A subclass of the bases' metaclass that pickles its classes as ``fsdp_class`` calls."""
    winner = type(bases[0])
    for base in bases[1:]:
        meta = type(base)
        if issubclass(meta, winner):
            winner = meta
        elif not issubclass(winner, meta):
            raise TypeError(
                f"fully_shard: cannot union {bases[-1].__name__} with plugin mixins "
                f"{[b.__name__ for b in bases[1:-1]]}: their metaclasses conflict"
            )
    unioned = _METACLASSES.get(winner)
    if unioned is None:
        name = winner.__name__
        unioned = _METACLASSES[winner] = type(
            f"FSDPUnioned{name[:1].upper()}{name[1:]}", (winner,), {}
        )
        copyreg.pickle(unioned, _reduce_unioned)
    return unioned


def _reduce_unioned(cls: type):
    return fsdp_class, (cls._hyperfsdp_orig_cls, cls._hyperfsdp_mixins)  # type: ignore[attr-defined]
