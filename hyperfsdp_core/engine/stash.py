"""Typed per-object storage for plugins (the idea of pytest's ``Stash``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar, cast

T = TypeVar("T")
D = TypeVar("D")


class StashKey(Generic[T]):
    """A key into a :class:`Stash`; the type parameter is the type of the value.

    Create one per piece of data, at module level in your plugin
    (``QUEUE = StashKey[MyQueue]()``); keys compare by identity, so two plugins can
    never collide.
    """

    __slots__ = ("name",)

    def __init__(self, name: str = "") -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"StashKey({self.name!r})" if self.name else object.__repr__(self)


class Stash:
    """Plugins' data attached to a core object (a parameter, a unit, a root).

    ``stash[key] = value``, ``stash[key]``, ``stash.get(key, default)``,
    ``stash.setdefault(key, factory)``, ``key in stash``, ``del stash[key]``.
    """

    __slots__ = ("_data",)

    def __init__(self) -> None:
        self._data: dict[StashKey[Any], Any] = {}

    def __setitem__(self, key: StashKey[T], value: T) -> None:
        self._data[key] = value

    def __getitem__(self, key: StashKey[T]) -> T:
        return cast(T, self._data[key])

    def get(self, key: StashKey[T], default: D) -> T | D:
        return cast("T | D", self._data.get(key, default))

    def setdefault(self, key: StashKey[T], factory: Callable[[], T]) -> T:
        """The value under ``key``; if there is none, ``factory()`` is stored first."""
        try:
            return cast(T, self._data[key])
        except KeyError:
            value = self._data[key] = factory()
            return value

    def __delitem__(self, key: StashKey[Any]) -> None:
        del self._data[key]

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)

    def values(self):
        return self._data.values()
