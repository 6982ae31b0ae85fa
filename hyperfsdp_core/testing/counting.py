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
#: memory, the core's gloo routes, FSDP2-style custom comms), it counts once, as what it is
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


def train_every_gather_layout(subgroup: bool = False) -> dict:
    """Train a small ``reference.Transformer`` three steps with a unit of each gather layout
    a transport meets, on the roots made inside: uneven dim-0 shards (block 0), the same in
    bf16 mixed precision (block 1), dim-1 members among dim-0 ones (block 2, gathered into
    strided parts of the buffer) and the root; ``subgroup``: FSDP over pairs of ranks (4
    ranks). Returns ``losses``, the final local ``params``, the core's collective counts by
    kind (``kinds``) and the ``model``: two transports that move the same bytes give the
    same of each, bit for bit."""
    import torch
    from torch.distributed.tensor import Shard

    from .. import MixedPrecisionPolicy, fully_shard
    from .reference import Transformer, lm_loss, local_slice, token_batch

    torch.manual_seed(0)
    model = Transformer(vocab=33, dim=12, n_layers=3, hidden=18)  # uneven shards
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh = None
    if subgroup:  # point-to-point in group ranks
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pair", "shard"))["shard"]
    for i, block in enumerate(model.layers):
        kwargs = {"mp_policy": mp} if i == 1 else {}
        if i == 2:
            kwargs["shard_placement_fn"] = lambda p: (
                Shard(1) if p.ndim == 2 and p.shape[1] % 4 == 0 else None
            )
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh)
    dim1 = [
        r.fqn
        for r in model.sharding_plan()
        if len(r.global_shape) == 2 and r.local_shape[1] != r.global_shape[1]
    ]
    assert dim1 == [
        "layers.2.attn.wqkv.weight",
        "layers.2.attn.wo.weight",
        "layers.2.mlp.w1.weight",
        "layers.2.mlp.w3.weight",
    ], dim1
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    with CollectiveCounter() as counter:
        for step in range(3):
            x, y = token_batch(step, 8, 5, 33)
            loss = lm_loss(model(local_slice(x)), local_slice(y))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return {
        "losses": losses,
        "params": [p.detach().to_local().clone() for p in model.parameters()],
        "kinds": {k: counter.count(k) for k in ("ag", "rs", "ar")},
        "model": model,
    }


def trainings_match(train, subgroup: bool = False) -> tuple:
    """Compare ``train(True, subgroup)`` with ``train(False, subgroup)``: two trainings (each
    returns its losses, final local parameters, collective counts and a tag of the transport
    it ran on, as from :func:`train_every_gather_layout`) through a route and without it.
    Returns ``(same losses, same parameters bit for bit, same counts, tag with, tag without)``."""
    import torch

    a = train(True, subgroup)
    b = train(False, subgroup)
    same_params = all(
        torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a[1], b[1])
    )
    return a[0] == b[0], same_params, a[2] == b[2], a[3], b[3]


def all_gather_routes_taken(sites: list[tuple[object, str, str]], rows: tuple[str, ...]) -> list:
    """The routes a transport's all-gathers take by size and layout: spies on ``sites``
    (``(owner, attribute, label)``; an owner that is a class is spied as a method) while
    three units gather once on a root made inside: 2304 bytes unsharded, 16640 with every
    member on dim 0, 16640 with a dim-1 member. Returns the sorted ``(label, bytes)`` pairs;
    a site labelled in ``rows`` gathers into a list of ``(world, n)`` views."""
    import torch
    from torch import nn
    from torch.distributed.tensor import Shard

    from .. import fully_shard

    calls: set[tuple[str, int]] = set()

    def spy(owner, label, fn):
        def call(*args, **kwargs):
            at = args[1:] if isinstance(owner, type) else args  # a method: after self
            views = at[0] if label in rows else [at[0]]
            calls.add((label, sum(v.numel() * v.element_size() for v in views)))
            return fn(*args, **kwargs)

        return call

    saved = [getattr(owner, name) for owner, name, _ in sites]
    for (owner, name, label), fn in zip(sites, saved):
        setattr(owner, name, spy(owner, label, fn))
    try:
        torch.manual_seed(0)
        small, big, big_dim1 = nn.Linear(8, 64), nn.Linear(64, 64), nn.Linear(64, 64)
        fully_shard(small)
        fully_shard(big)
        fully_shard(big_dim1, shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None)
        model = nn.Sequential(small, big, big_dim1)
        fully_shard(model)
        model(torch.randn(2, 8) + dist.get_rank()).sum().backward()
        return sorted(calls)
    finally:
        for (owner, name, _), fn in zip(sites, saved):
            setattr(owner, name, fn)
