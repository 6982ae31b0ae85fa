"""The plugin's switches: this module's values where set (tests), else the environment's,
read when a root's transport is made (its lazy init) or a ``hyperfsdp_shm`` group's
shared memory is (its first collective).

- ``HYPERFSDP_SHM=0`` (:data:`SHM` ``False``): no shared memory, the gloo stand-ins only;
- ``HYPERFSDP_GLOO_NATIVE_COLLECTIVES=1`` (:data:`GLOO_ALL_REDUCE` ``False``): no
  transport at all: the core's default, torch.distributed's own collectives;
- ``HYPERFSDP_GLOO_ALL_GATHER_MIN_BYTES`` (:data:`GLOO_ALL_GATHER_MIN_BYTES`, 1 MiB):
  all-gathers below it, where no shared memory takes them, use gloo's own (one exchange,
  where an all-reduce makes two: 0.35 against 0.55 ms for 4 KiB at world 2);
- ``HYPERFSDP_SHM_DIR`` (:data:`SHM_DIR`, ``/dev/shm``): the directory the segment files
  are made in (a tmpfs: another one where ``/dev/shm`` is small, or a private one in tests),
  read when a group's shared memory is made (members exchange full paths).
"""

from __future__ import annotations

import os

GLOO_ALL_REDUCE: bool | None = None
GLOO_ALL_GATHER_MIN_BYTES: int | None = None
SHM: bool | None = None
SHM_DIR: str | None = None


def settings() -> tuple[bool, int, bool]:
    """``(GLOO_ALL_REDUCE, GLOO_ALL_GATHER_MIN_BYTES, SHM)`` as they are now: this module's
    values where set, else the environment's."""
    env = os.environ
    gloo = GLOO_ALL_REDUCE
    if gloo is None:
        gloo = env.get("HYPERFSDP_GLOO_NATIVE_COLLECTIVES", "") != "1"
    min_bytes = GLOO_ALL_GATHER_MIN_BYTES
    if min_bytes is None:
        min_bytes = int(env.get("HYPERFSDP_GLOO_ALL_GATHER_MIN_BYTES", 1 << 20))
    shm = SHM if SHM is not None else env.get("HYPERFSDP_SHM", "") != "0"
    return gloo, min_bytes, shm


def shm_dir() -> str:
    """Where the segment files are made: :data:`SHM_DIR` where set, else
    ``HYPERFSDP_SHM_DIR``, else ``/dev/shm``."""
    return SHM_DIR or os.environ.get("HYPERFSDP_SHM_DIR") or "/dev/shm"
