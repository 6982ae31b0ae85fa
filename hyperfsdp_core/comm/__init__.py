"""The communication layer: how bytes move between ranks.

The only layer that calls ``torch.distributed`` collectives. A bucket asks its
:class:`Transport` once per collective: what a plugin supplies through
``hyperfsdp_transport``, else the root's default (on CPU :class:`GlooTransport`, gloo's
collectives without its full-size buffers; elsewhere torch.distributed's own). :class:`Comm`
issues them with async :class:`Handle` objects, accelerator streams and events, and pooled
buffers; :class:`PluginComm` is the facade plugins use. Other layers import from this
package.

Modules, lowest first: ``records`` (:class:`CollectiveEvent`, :func:`report_wire`),
``transport`` (the seam), ``gloo`` (the CPU default), ``handles`` (pending collectives),
``pools`` (CPU buffer and storage pools), ``comm`` (:class:`Comm`, issuing),
``plugin_comm`` (:class:`PluginComm`, :data:`Work`), ``exit`` (draining collectives at
interpreter exit).
"""

from .comm import Comm
from .gloo import GlooTransport
from .handles import READY, Handle
from .plugin_comm import PluginComm, Work
from .pools import StoragePool
from .records import CollectiveEvent, report_wire
from .transport import Transport, compose_transport

__all__ = [
    "READY",
    "CollectiveEvent",
    "Comm",
    "GlooTransport",
    "Handle",
    "PluginComm",
    "StoragePool",
    "Transport",
    "Work",
    "compose_transport",
    "report_wire",
]
