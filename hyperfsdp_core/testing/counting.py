"""Count the collectives hyperfsdp issues, at the point where it calls torch.distributed."""

from __future__ import annotations

import torch.distributed as dist

from .. import _collectives as _coll

#: the core's call sites; on gloo its all-gathers and reduce-scatters run through shared
#: memory, point to point or as in-place all-reduces (``_collectives.SHM``,
#: ``GLOO_ALL_REDUCE``), counted as the all-gathers and reduce-scatters they are
KINDS = {
    "_all_gather": "ag",
    "_all_gather_by_all_reduce": "ag",
    "_all_gather_p2p": "ag",
    "_all_gather_shm": "ag",
    "_all_gather_rows_shm": "ag",
    "_reduce_scatter": "rs",
    "_reduce_scatter_in_place": "rs",
    "_reduce_scatter_pair": "rs",
    "_reduce_scatter_shm": "rs",
    "_all_reduce": "ar",
}


class CollectiveCounter:
    """Context manager recording ``(kind, group size, reduce op or None)`` per collective.

    ``kind`` is ``"ag"``, ``"rs"`` or ``"ar"``. Custom comms set with
    ``set_custom_all_gather``/``set_custom_reduce_scatter`` and transports that plugins
    supply (``hyperfsdp_transport``) bypass these call sites; a collective observer
    (``hyperfsdp_collective_observer``) sees those too.
    """

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, str | None]] = []
        self._orig: dict[str, object] = {}

    def __enter__(self) -> CollectiveCounter:
        for attr, kind in KINDS.items():
            fn = getattr(_coll, attr)
            self._orig[attr] = fn
            setattr(_coll, attr, self._wrap(kind, fn))
        return self

    def __exit__(self, *exc) -> None:
        for attr, fn in self._orig.items():
            setattr(_coll, attr, fn)

    def _wrap(self, kind: str, fn):
        def call(*args, **kwargs):
            op = kwargs.get("op")
            self.calls.append(
                (
                    kind,
                    dist.get_world_size(kwargs.get("group")),
                    str(op) if op is not None else None,
                )
            )
            return fn(*args, **kwargs)

        return call

    def count(self, kind: str) -> int:
        return sum(1 for k, *_ in self.calls if k == kind)

    def sizes(self, kind: str) -> list[int]:
        return [n for k, n, _ in self.calls if k == kind]
