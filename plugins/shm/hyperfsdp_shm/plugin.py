"""The shared-memory plugin's hooks (entry point ``shm``).

It supplies the transport of every unit that computes on the CPU
(``hyperfsdp_transport``), one per root, which holds the root's shared-memory groups:
ranks of one host all-gather and reduce-scatter through shared memory; other groups go on
through the core's own gloo routes, which ``ShmTransport`` extends (``_transport.py``). It
runs last (``trylast``): a transport that another plugin supplies for a unit wins.
``HYPERFSDP_SHM=0`` or ``HYPERFSDP_GLOO_NATIVE_COLLECTIVES=1`` (read at each root's lazy
init) supplies none: the core's default then, as without this plugin (or with
``HYPERFSDP_PLUGINS_DISABLE=shm``). Written against ``hyperfsdp_core.plugin`` only.
"""

from __future__ import annotations

from hyperfsdp_core.plugin import GlooTransport, StashKey, Transport, UnitView, hookimpl

from . import _settings, _transport

HYPERFSDP_API = ">=1.2,<2"  # GlooTransport, modes_set_aside

#: the root's transport, shared by its units (one set of shared-memory groups per root)
ROOT_TRANSPORT: StashKey[Transport | None] = StashKey("shm.transport")


def _make() -> Transport | None:
    if not (_settings.use_shm() and GlooTransport.enabled()):
        return None
    return _transport.ShmTransport(True)


@hookimpl(trylast=True)
def hyperfsdp_transport(unit: UnitView) -> Transport | None:
    if unit.device.type != "cpu":
        return None
    root = unit.root
    if root is None:  # not expected at lazy init; a transport of its own then
        return _make()
    return root.stash.setdefault(ROOT_TRANSPORT, _make)
