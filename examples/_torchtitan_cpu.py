"""What the torchtitan examples need to import torchtitan 0.3.0 on a CPU-only torch.

Used by ``examples/torchtitan_tp.py`` and ``examples/torchtitan_pp.py`` (and, through
``torchtitan_tp``, ``plugins/qcomm/examples/torchtitan_qcomm.py``); not part of hyperfsdp.
"""

from __future__ import annotations

import sys
import types

#: the one torchtitan module that imports triton at import time
TRITON_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"


def stub_triton_kernels() -> None:
    """Stand a placeholder in for torchtitan's expert-parallel triton kernels, before
    torchtitan is imported.

    ``torchtitan.models.common`` imports the MoE token dispatcher, which imports these
    kernels, and with them triton, which a CPU-only torch lacks. The dense Llama path never
    calls them: any attribute of the placeholder is a function that raises
    ``NotImplementedError`` when called. A real module already imported is left alone.
    """

    class _Missing(types.ModuleType):
        def __getattr__(self, attr):
            if attr.startswith("__"):
                raise AttributeError(attr)

            def missing(*args, **kwargs):
                raise NotImplementedError(f"{TRITON_KERNELS}.{attr} needs triton")

            return missing

    sys.modules.setdefault(TRITON_KERNELS, _Missing(TRITON_KERNELS))
