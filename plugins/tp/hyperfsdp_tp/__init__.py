"""Tensor parallelism for hyperfsdp (entry point ``tp``): FSDP and HSDP over DTensor parameters.

``replicate_module`` makes a module's parameters replicated DTensors on the TP mesh (for
norms outside sequence parallelism: a ``fully_shard`` unit is all DTensors or all plain).
"""

from .styles import replicate_module

__all__ = ["replicate_module"]
