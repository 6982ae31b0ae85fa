"""The private PyTorch names the built-in plugins use, each with its reason (as every plugin
keeps its own; the core's are in ``hyperfsdp_core/_torch_private.py``, which a plugin does
not import).

- ``tree_map``: mixed precision casts a unit's forward inputs and outputs wherever they sit
  in nested containers, with torch's own pytree walk (as FSDP2 does); torch has no public
  pytree module.
"""

from torch.utils._pytree import tree_map

__all__ = ["tree_map"]
