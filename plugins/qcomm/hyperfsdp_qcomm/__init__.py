"""Quantized collectives for hyperfsdp (entry point ``qcomm``).

Opt in per model or per unit, before the root's first forward (the transport is chosen at
lazy init)::

    import hyperfsdp_qcomm

    hyperfsdp_qcomm.enable(model)                       # every unit under model
    hyperfsdp_qcomm.enable(model.output, all_gather=None)  # override one unit

See the README for the policy and the numerical contract.
"""

from __future__ import annotations

import collections
import dataclasses

from torch import nn

from ._quant import dequantize_rows, error_bound, packed_size, quantize_rows

__all__ = [
    "ATTRIBUTE",
    "WIRE_BYTES",
    "QCommPolicy",
    "dequantize_rows",
    "disable",
    "enable",
    "error_bound",
    "packed_size",
    "policy_of",
    "quantize_rows",
]

#: the module attribute holding a module's :class:`QCommPolicy`
ATTRIBUTE = "hyperfsdp_qcomm_policy"

#: bytes this process put on the wire per ``(unit fqn, collective, route)``: collective is
#: ``"all_gather"`` (the gathered output) or ``"reduce_scatter"`` (the input sent); route is
#: ``"int8"``, ``"bf16"`` or ``"exact"`` (the plain collective: a fallback or an
#: unquantized dtype). Same convention as ``CollectiveEvent.nbytes`` (the larger side).
WIRE_BYTES: collections.Counter = collections.Counter()

_AG_MODES = ("int8", "bf16", None)
_RS_MODES = ("int8", "bf16", None)


@dataclasses.dataclass(frozen=True)
class QCommPolicy:
    """What a unit's collectives put on the wire.

    - ``all_gather``: ``"int8"`` (block-quantized, fp32 scale per ``block`` values),
      ``"bf16"`` or ``None`` (exact).
    - ``reduce_scatter``: ``"int8"`` or ``"bf16"`` on the wire, always summed in fp32 on the
      receiving rank; ``None``: the exact collective.
    - ``block``: values per int8 scale (a positive multiple of 4).
    - ``min_numel``: collectives of fewer values (the unsharded size of the bucket) stay
      exact: there latency dominates and quantizing costs more than it saves.
    """

    all_gather: str | None = "int8"
    reduce_scatter: str | None = "int8"
    block: int = 256
    min_numel: int = 1 << 16

    def __post_init__(self) -> None:
        if self.all_gather not in _AG_MODES:
            raise ValueError(f"all_gather must be one of {_AG_MODES}, got {self.all_gather!r}")
        if self.reduce_scatter not in _RS_MODES:
            raise ValueError(
                f"reduce_scatter must be one of {_RS_MODES}, got {self.reduce_scatter!r}"
            )
        if not isinstance(self.block, int) or self.block <= 0 or self.block % 4:
            raise ValueError(f"block must be a positive multiple of 4, got {self.block!r}")
        if not isinstance(self.min_numel, int) or self.min_numel < 0:
            raise ValueError(f"min_numel must be an int >= 0, got {self.min_numel!r}")

    @property
    def active(self) -> bool:
        return self.all_gather is not None or self.reduce_scatter is not None


def enable(
    module: nn.Module,
    *,
    all_gather: str | None = "int8",
    reduce_scatter: str | None = "int8",
    block: int = 256,
    min_numel: int = 1 << 16,
    recurse: bool = True,
) -> QCommPolicy:
    """Quantize the collectives of the units rooted at ``module`` (and, with ``recurse``,
    of every unit under it). Call before the root's first forward; a later call wins for
    the modules it covers. Returns the policy set."""
    policy = QCommPolicy(all_gather, reduce_scatter, block, min_numel)
    for m in module.modules() if recurse else (module,):
        setattr(m, ATTRIBUTE, policy)
    return policy


def disable(module: nn.Module, *, recurse: bool = True) -> None:
    """Exact collectives for the units rooted at ``module`` (and under it)."""
    for m in module.modules() if recurse else (module,):
        if ATTRIBUTE in m.__dict__:
            delattr(m, ATTRIBUTE)


def policy_of(modules) -> QCommPolicy | None:
    """The policy of a unit's modules (the first that has one), or ``None``."""
    for m in modules:
        policy = m.__dict__.get(ATTRIBUTE)
        if policy is not None:
            return policy
    return None
