"""The plugin's switches: this module's values where set (tests), else the environment's,
read when a root's transport is made (its lazy init) or a ``hyperfsdp_shm`` group's
shared memory is (its first collective).

- ``HYPERFSDP_SHM=0`` (:data:`SHM` ``False``): no shared memory; the plugin supplies no
  transport, and the core's own gloo routes carry the collectives, as without the plugin;
- ``HYPERFSDP_SHM_DIR`` (:data:`SHM_DIR`, ``/dev/shm``): the directory the segment files
  are made in (a tmpfs: another one where ``/dev/shm`` is small, or a private one in tests),
  read when a group's shared memory is made (members exchange full paths).

The core's switches apply too: ``HYPERFSDP_GLOO_NATIVE_COLLECTIVES=1`` (gloo's own
collectives: the plugin supplies no transport either) and
``HYPERFSDP_GLOO_ALL_GATHER_MIN_BYTES`` (docs/design.md).
"""

from __future__ import annotations

import os

SHM: bool | None = None
SHM_DIR: str | None = None


def use_shm() -> bool:
    """:data:`SHM` as it is now: this module's value where set, else the environment's."""
    return SHM if SHM is not None else os.environ.get("HYPERFSDP_SHM", "") != "0"


def shm_dir() -> str:
    """Where the segment files are made: :data:`SHM_DIR` where set, else
    ``HYPERFSDP_SHM_DIR``, else ``/dev/shm``."""
    return SHM_DIR or os.environ.get("HYPERFSDP_SHM_DIR") or "/dev/shm"
