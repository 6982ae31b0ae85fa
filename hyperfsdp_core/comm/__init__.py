"""The communication layer: how bytes move between ranks.

The only layer that calls ``torch.distributed`` collectives. A bucket asks its
:class:`Transport` once per collective (torch.distributed's own by default, or what a
plugin supplies through ``hyperfsdp_transport``); :class:`Comm` issues them with async
:class:`Handle` objects, accelerator streams and events, and pooled buffers;
:class:`PluginComm` is the facade plugins use. Other layers import from this package.
"""

from .collectives import (
    READY,
    Comm,
    Handle,
    PluginComm,
    StoragePool,
    Transport,
    Work,
    compose_transport,
)
from .records import CollectiveEvent

__all__ = [
    "READY",
    "CollectiveEvent",
    "Comm",
    "Handle",
    "PluginComm",
    "StoragePool",
    "Transport",
    "Work",
    "compose_transport",
]
