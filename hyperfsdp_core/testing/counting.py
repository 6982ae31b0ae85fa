"""Count collectives: those hyperfsdp issues, where the core issues them (``Comm``:
:class:`CollectiveCounter`), the bytes its collective observer sees (:class:`ObservedBytes`),
and the bytes torch.distributed's own calls move (:class:`TorchCollectiveBytes`: FSDP2's, or
what a transport really sends)."""

from __future__ import annotations

import collections

import torch.distributed as dist

from ..comm import Comm
from ..plugin.manager import hookimpl

#: the core's issue points and the kind each counts as: whichever transport then carries
#: the collective (torch.distributed's own, a plugin's such as ``hyperfsdp-shm``'s shared
#: memory or gloo stand-ins, FSDP2-style custom comms), it counts once, as what it is
KINDS = {
    "all_gather": "ag",
    "all_gather_rows": "ag",
    "all_gather_in_place": "ag",
    "reduce_scatter": "rs",
    "all_reduce": "ar",
}


#: where a ``Comm`` method takes its group, (reductions) its op and its transport,
#: positionally, and the transport's comm object that, set, carries the collective instead
#: (FSDP2-style ``set_custom_*`` comms and a transport's own parts bypass the count)
_PLACES = {
    "all_gather": (2, None, 3, "all_gather_comm"),
    "all_gather_rows": (3, None, 4, "all_gather_comm"),
    "all_gather_in_place": (1, None, 2, "all_gather_comm"),
    "reduce_scatter": (2, 3, 4, "reduce_scatter_comm"),
    "all_reduce": (1, 2, 3, "all_reduce_fn"),
}


def _arg(args: tuple, kwargs: dict, name: str, at: int | None):
    if at is None:
        return None
    return kwargs[name] if name in kwargs else args[at]


class CollectiveCounter:
    """Context manager recording ``(kind, group size, reduce op or None)`` per collective
    the core issues (its buckets' and what plugins issue through ``root.comm``).

    ``kind`` is ``"ag"``, ``"rs"`` or ``"ar"``. Collectives carried by custom comm objects
    (``set_custom_all_gather``/``set_custom_reduce_scatter``, the comm objects of a
    plugin's ``Transport``) are not counted, nor those that bypass the core (DTensor's
    own, a plugin calling ``torch.distributed`` directly); a collective observer
    (``hyperfsdp_collective_observer``) sees every collective the core issues.
    """

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, str | None]] = []
        self._orig: dict[str, object] = {}

    def __enter__(self) -> CollectiveCounter:
        for method, kind in KINDS.items():
            fn = getattr(Comm, method)
            self._orig[method] = fn
            setattr(Comm, method, self._wrap(method, kind, fn))
        return self

    def __exit__(self, *exc) -> None:
        for method, fn in self._orig.items():
            setattr(Comm, method, fn)

    def _wrap(self, method: str, kind: str, fn):
        group_at, op_at, transport_at, custom = _PLACES[method]

        def call(comm, *args, **kwargs):
            transport = args[transport_at] if len(args) > transport_at else None
            transport = kwargs.get("transport", transport)
            if transport is not None and getattr(transport, custom, None) is not None:
                return fn(comm, *args, **kwargs)
            op = _arg(args, kwargs, "op", op_at)
            self.calls.append(
                (
                    kind,
                    dist.get_world_size(_arg(args, kwargs, "group", group_at)),
                    str(op) if op is not None else None,
                )
            )
            return fn(comm, *args, **kwargs)

        return call

    def count(self, kind: str) -> int:
        return sum(1 for k, *_ in self.calls if k == kind)

    def sizes(self, kind: str) -> list[int]:
        return [n for k, n, _ in self.calls if k == kind]


class ObservedBytes:
    """A plugin (register it with :func:`hyperfsdp_core.testing.registered`) whose
    collective observer sums the bytes of the collectives the core issues, by
    ``CollectiveEvent.kind`` (``bytes["all_gather"]``...): the logical collectives in
    ``bytes``, what their transports reported putting on the wire in ``wire_bytes``."""

    def __init__(self) -> None:
        self.bytes: collections.Counter = collections.Counter()
        self.wire_bytes: collections.Counter = collections.Counter()

    @hookimpl
    def hyperfsdp_collective_observer(self, root):
        def observe(event):
            self.bytes[event.kind] += event.nbytes
            self.wire_bytes[event.kind] += event.wire_nbytes

        return observe


class TorchCollectiveBytes:
    """Context manager summing the bytes torch.distributed's own calls move, by kind, at
    the calls themselves (what FSDP2 sends, or what a transport really puts on the wire).

    ``calls``: ``{torch.distributed function name: (kind, index of the tensor counted)}``;
    the default counts all-gather outputs.
    """

    ALL_GATHERS = {
        "all_gather_single": ("all_gather", 0),
        "all_gather_into_tensor": ("all_gather", 0),
    }

    def __init__(self, calls: dict[str, tuple[str, int]] | None = None) -> None:
        self.calls = self.ALL_GATHERS if calls is None else calls
        self.bytes: collections.Counter = collections.Counter()
        self._orig: dict = {}

    def __enter__(self) -> TorchCollectiveBytes:
        for name, (kind, at) in self.calls.items():
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._orig[name] = fn

            def wrapped(*args, _fn=fn, _kind=kind, _at=at, **kwargs):
                t = args[_at]
                self.bytes[_kind] += t.numel() * t.element_size()
                return _fn(*args, **kwargs)

            setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._orig.items():
            setattr(dist, name, fn)
        self._orig = {}
