"""use_as_fsdp2(): hyperfsdp behind torch's own FSDP2 names, for frameworks that import them.

accelerate (the transformers ``Trainer``'s FSDP2 path), PyTorch Lightning and torchtune call
``torch.distributed.fsdp.fully_shard`` themselves; their users cannot edit that import. The
switch points torch's public FSDP2 names (``fully_shard``, ``FSDPModule``, the policies, ...)
at hyperfsdp's, in every module code imports them from (``torch.distributed.fsdp`` and the
private aliases frameworks use), for the whole process, until it is restored.

Code that imports a name *when it runs* (accelerate's ``fsdp2_prepare_model``, Lightning's
gradient-sync switch) sees hyperfsdp's while the switch is on. Code that binds a name *when
it is imported* keeps what it bound then: turn the switch on before importing it (torchtitan's
``torchtitan.distributed.fsdp``). torch's own pipelining is imported first and keeps torch's
objects, which hyperfsdp's units satisfy (see ``_torch_private.expose_fsdp2_state``).
"""

from __future__ import annotations

import threading

from . import api, module, policies
from ._torch_private import bind_torch_fsdp2_users, fsdp2_namespaces, torch_fsdp2_objects

#: hyperfsdp's object for each of torch's public FSDP2 names.
_OURS = {
    "fully_shard": api.fully_shard,
    "FSDPModule": module.FSDPModule,
    "UnshardHandle": module.UnshardHandle,
    "register_fsdp_forward_method": api.register_fsdp_forward_method,
    "share_comm_ctx": api.share_comm_ctx,
    "MixedPrecisionPolicy": policies.MixedPrecisionPolicy,
    "OffloadPolicy": policies.OffloadPolicy,
    "CPUOffloadPolicy": policies.CPUOffloadPolicy,
    "DataParallelMeshDims": policies.DataParallelMeshDims,
}

_lock = threading.Lock()
_active = 0  # switches not yet restored; torch's names point at hyperfsdp's while > 0
_replaced: list[tuple[object, str, object]] = []  # (namespace, name, what it held before)


class FSDP2Switch:
    """What :func:`use_as_fsdp2` returns: the switch, on until :meth:`restore` (or the end of
    a ``with`` block). Several may be on at once; torch's names get their own objects back
    when the last one is restored, whatever the order."""

    def __init__(self) -> None:
        self._on = True

    @property
    def active(self) -> bool:
        """Whether this switch is still on (not yet restored)."""
        return self._on

    def restore(self) -> None:
        """Undo this switch (idempotent)."""
        global _active
        with _lock:
            if not self._on:
                return
            self._on = False
            _active -= 1
            if _active == 0:
                for namespace, name, before in reversed(_replaced):
                    setattr(namespace, name, before)
                _replaced.clear()

    def __enter__(self) -> FSDP2Switch:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.restore()

    def __repr__(self) -> str:
        return f"<hyperfsdp use_as_fsdp2 switch, {'on' if self._on else 'restored'}>"


def use_as_fsdp2() -> FSDP2Switch:
    """Point torch's public FSDP2 names at hyperfsdp's, for this process.

    After it, ``from torch.distributed.fsdp import fully_shard, FSDPModule,
    MixedPrecisionPolicy, ...`` (or the ``torch.distributed._composable.fsdp`` path) gives
    hyperfsdp's objects, so frameworks that call torch's ``fully_shard`` (accelerate and the
    transformers ``Trainer``, Lightning's ``ModelParallelStrategy``, torchtune, torchtitan)
    shard with hyperfsdp. Code that imported a name before the switch keeps what it imported;
    policy objects built from torch's classes before it are accepted, with their meaning.

    Returns the switch: ``.restore()`` undoes it, and ``with use_as_fsdp2(): ...`` scopes it
    to the block.
    """
    global _active
    bind_torch_fsdp2_users()
    torch_objects = torch_fsdp2_objects()
    with _lock:
        if _active == 0:
            for namespace in fsdp2_namespaces():
                for name, ours in _OURS.items():
                    if name in torch_objects and hasattr(namespace, name):
                        _replaced.append((namespace, name, getattr(namespace, name)))
                        setattr(namespace, name, ours)
        _active += 1
    return FSDP2Switch()
