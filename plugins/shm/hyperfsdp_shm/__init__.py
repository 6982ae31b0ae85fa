"""Shared-memory collectives for hyperfsdp on CPU (entry point ``shm``).

Installed (``pip install hyperfsdp[shm]``), it carries every CPU unit's all-gathers and
reduce-scatters: through shared memory between the ranks of one host, through gloo
stand-ins without gloo's full-size buffers elsewhere (``plugin.py``). Without it the core
runs torch.distributed's own collectives. :func:`register_shm_backend` registers the same
transport as a c10d backend, ``hyperfsdp_shm``, for collectives hyperfsdp does not issue.
"""

from ._backend import BACKEND, register_shm_backend
from ._shm import ShmCollectiveError

__all__ = ["BACKEND", "ShmCollectiveError", "register_shm_backend"]
