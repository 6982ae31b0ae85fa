"""The communication layer: how bytes move between ranks.

The only layer that calls ``torch.distributed`` collectives. A bucket asks its
:class:`Transport` once per collective (torch.distributed's own by default, or what a
plugin supplies through ``hyperfsdp_transport``); :class:`Comm` issues them with async
:class:`Handle` objects, accelerator streams and events, and pooled buffers;
:class:`PluginComm` is the facade plugins use. Other layers import from this package.

Modules, lowest first: ``records`` (:class:`CollectiveEvent`, :func:`report_wire`),
``transport`` (the seam), ``handles`` (pending collectives), ``pools`` (CPU buffer and
storage pools), ``comm`` (:class:`Comm`, issuing), ``plugin_comm`` (:class:`PluginComm`,
:data:`Work`), ``exit`` (draining collectives at interpreter exit).
"""

from .comm import Comm
from .handles import READY, Handle
from .plugin_comm import PluginComm, Work
from .pools import StoragePool
from .records import CollectiveEvent, report_wire
from .transport import Transport, compose_transport

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
    "report_wire",
]
