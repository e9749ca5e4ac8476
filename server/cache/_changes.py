"""The data plane's one change stream: every change to what it holds, in
the order it happened, to every subscriber (the mirror feed, the item
events, the L2 tier), each called in turn with no await between.

The store publishes what L1 stored and removed (an eviction says so), the
uploads in flight what began and ended, the L2 tier what it wrote: a
subscriber takes what it needs and ignores the rest.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ._types import Change

__all__ = ["ItemChange", "ItemChanges", "Listener"]


@dataclass(frozen=True, slots=True)
class ItemChange:
    kind: Change
    key: str  # the store's key: the hash in its namespace
    size: int = 0  # STORED: the bytes charged
    evicted: bool = False  # REMOVED to make room for others
    in_l2: bool = False  # STORED in the L2 tier, not L1 (no change to L1's key set)


Listener = Callable[[ItemChange], None]


class ItemChanges:
    """Subscribers, called in the order they subscribed."""

    def __init__(self) -> None:
        self._listeners: list[Listener] = []

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def publish(self, change: ItemChange) -> None:
        for listener in self._listeners:
            listener(change)

    @contextlib.contextmanager
    def listening(self, listener: Listener) -> Iterator[None]:
        """`listener` hears the changes made within the block only."""
        self._listeners.append(listener)
        try:
            yield
        finally:
            self._listeners.remove(listener)
