"""What a checkpoint holds: the layout of its sections and how they are gathered and restored.

A checkpoint is an ordinary ``torch.distributed.checkpoint`` (DCP) directory whose top-level
keys are sections:

- ``model``: ``get_state_dict(model, ...)[0]``, keyed by parameter and buffer FQN (sharded
  parameters are DTensors: DCP stores each rank's actual rows, never padding);
- ``optim``: ``get_state_dict(model, optimizers)[1]`` (state keyed by parameter FQN);
- one section per extra stateful object (LR scheduler, data loader...): its ``state_dict()``,
  serialized whole, one item per rank (``<name>.rank_<r>``);
- ``trainer``: ``{"step", "world_size", "format"}`` (written by hyperfsdp-dcp);
- ``rng``: one entry per rank, ``rank_<r>``, with that rank's RNG states.

A torch FSDP2 program that saves ``{"model": model_sd, "optim": optim_sd}`` with DCP writes
the same layout, which is what lets checkpoints move between FSDP2 and hyperfsdp.
"""

from __future__ import annotations

import io
import random
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

MODEL = "model"
OPTIM = "optim"
TRAINER = "trainer"
RNG = "rng"
RESERVED = (MODEL, OPTIM, TRAINER, RNG)
FORMAT = 1


def as_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    if optimizer is None:
        return []
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    optimizers = list(optimizer)
    for opt in optimizers:
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(
                f"hyperfsdp-dcp: optimizer= takes a torch.optim.Optimizer or a sequence of them, "
                f"got {type(opt).__name__}"
            )
    return optimizers


def check_stateful(stateful: Mapping[str, Any] | None) -> dict[str, Stateful]:
    out: dict[str, Stateful] = {}
    for name, obj in (stateful or {}).items():
        if name in RESERVED or "." in name or not name:
            raise ValueError(
                f"hyperfsdp-dcp: stateful name {name!r} is not allowed: names must be non-empty, "
                f"contain no '.', and differ from the reserved sections {RESERVED}"
            )
        if not (
            callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None))
        ):
            raise TypeError(
                f"hyperfsdp-dcp: stateful[{name!r}] ({type(obj).__name__}) needs state_dict() and "
                "load_state_dict() methods (an LR scheduler, a data loader wrapper...)"
            )
        out[name] = obj
    return out


class TrainState:
    """The model, its optimizers and extra stateful objects, as one checkpointable unit.

    The model and optimizers go to DCP as sharded state dicts. A stateful object's
    ``state_dict()`` is stored whole, as one opaque item per rank (``<name>.rank_<r>``):
    DCP would otherwise flatten it, turn integer keys into strings on load (a
    ``MultiStepLR``'s milestones) and keep only one rank's copy of per-rank state (a data
    loader's position).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Any = None,
        stateful: Mapping[str, Any] | None = None,
        options: StateDictOptions | None = None,
    ) -> None:
        self.model = model
        self.optimizers = as_optimizers(optimizer)
        self.stateful = check_stateful(stateful)
        self.options = options or StateDictOptions()

    def collect(self, rank: str) -> dict[str, Any]:
        """The sections to save; model and optimizer tensors are not copied."""
        msd, osd = get_state_dict(self.model, self.optimizers, options=self.options)
        out: dict[str, Any] = {MODEL: msd}
        if self.optimizers:
            out[OPTIM] = osd
        for name, obj in self.stateful.items():
            buffer = io.BytesIO()
            torch.save(obj.state_dict(), buffer)
            out[name] = {rank: buffer.getvalue()}
        return out

    def template(
        self, stored: Sequence[str], rank: str
    ) -> tuple[dict[str, Any], list[torch.optim.Optimizer], dict[str, str]]:
        """What to load into: the model and optimizer state dicts (tensors alias the live
        ones) and a placeholder per stateful object; also the optimizers whose state this
        initialized (``get_state_dict`` gives a stateless optimizer zero state, which the
        caller clears again if the load is abandoned), and which rank's copy each stateful
        object reads (its own, else rank 0's: the world size changed)."""
        fresh = [opt for opt in self.optimizers if not opt.state]
        msd, osd = get_state_dict(self.model, self.optimizers, options=self.options)
        out: dict[str, Any] = {MODEL: msd}
        if self.optimizers:
            out[OPTIM] = osd
        chosen = {}
        keys = set(stored)
        for name in self.stateful:
            key = rank if f"{name}.{rank}" in keys else "rank_0"
            chosen[name] = key
            out[name] = {key: None}
        return out, fresh, chosen

    def decode(self, loaded: Mapping[str, Any], chosen: Mapping[str, str]) -> dict[str, Any]:
        """Each stateful object's state, unpickled from its loaded item (nothing is applied)."""
        return {
            name: torch.load(io.BytesIO(loaded[name][chosen[name]]), weights_only=False)
            for name in self.stateful
        }

    def apply(self, loaded: Mapping[str, Any], decoded: Mapping[str, Any]) -> None:
        """Apply loaded sections: model and optimizers through ``set_state_dict``, then each
        stateful object's decoded state."""
        if self.optimizers:
            set_state_dict(
                self.model,
                self.optimizers,
                model_state_dict=loaded[MODEL],
                optim_state_dict=loaded[OPTIM],
                options=self.options,
            )
        else:
            set_model_state_dict(self.model, loaded[MODEL], options=self.options)
        for name, obj in self.stateful.items():
            obj.load_state_dict(decoded[name])


# -- the trainer section and RNG states --------------------------------------------------------


def trainer_section(step: int | None, world_size: int) -> dict[str, Any]:
    return {"step": -1 if step is None else int(step), "world_size": world_size, "format": FORMAT}


def rng_state() -> dict[str, Any]:
    """This process's RNG states, as plain Python objects (bytes, tuples)."""
    import numpy as np  # a dependency of this distribution, imported when first needed

    state: dict[str, Any] = {
        "torch": torch.get_rng_state().numpy().tobytes(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.numpy().tobytes() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))
    random.setstate(state["python"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        states = [torch.frombuffer(bytearray(s), dtype=torch.uint8) for s in state["cuda"]]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)


def rank_key(group: dist.ProcessGroup | None) -> str:
    return f"rank_{dist.get_rank(group) if dist.is_initialized() else 0}"


# -- DCP's key flattening ----------------------------------------------------------------------


def flatten(state: Mapping[str, Any]) -> dict[str, Any]:
    """The keys DCP stores for a nested state dict, mapped to their leaves.

    Follows DCP's traversal: mappings are entered (keys become strings joined by '.'),
    lists are entered only when they hold tensors or non-leaf containers (by index), and
    everything else (tuples included) is a leaf.
    """
    out: dict[str, Any] = {}

    def is_leaf(value: Any) -> bool:
        if isinstance(value, Mapping):
            return False
        if not isinstance(value, list):
            return True
        for entry in value:
            if isinstance(entry, (Mapping, list)) and not is_leaf(entry):
                return False
            if isinstance(entry, torch.Tensor):
                return False
        return True

    def visit(path: tuple[str, ...], value: Any) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                visit((*path, str(k)), v)
        elif is_leaf(value):
            out[".".join(path)] = value
        else:
            for i, v in enumerate(value):
                visit((*path, str(i)), v)

    for key, value in state.items():
        visit((str(key),), value)
    return out
