"""Namespaces: tenants of one server that never see each other's items.

A call names its namespace in the `mmcache-namespace` metadata entry (e.g.
the model and its processor version); none names the default namespace "".
Items of namespace N live in the one store under the key "N\\0hash", the
default namespace's under the bare hash (hashes cannot hold a NUL, so no
hash of one namespace can spell a key of another). Namespaces therefore
share the capacity and one LRU order: a busy namespace takes room from a
quiet one as a busy modality does, and nothing has to be sized per tenant.

Each namespace has a mirror feed of its own (its own sequence numbers), and
every hash a reply names is stripped back to its caller's. Namespaces that
hold no item, upload or subscriber are forgotten when the server holds
`max_namespaces` and a call names a new one. A namespace named again starts
its feed's numbers at the server-wide count of changes, past any number it
used before, so no client's mirror mistakes its new facts for older ones.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from mmcache._errors import ResourceExhaustedError
from mmcache._spec import (
    NAMESPACE_KEY,
    NAMESPACE_SEP,
    check_count,
    check_name,
    check_namespace,
    store_key,
)

from ._config import ServerConfig
from ._feed import Feed
from .cache import Change, FeedState, ItemChange

__all__ = ["Namespace", "Namespaces", "namespace_name", "split_key"]

_SCAN_EVERY_S = 1.0


def split_key(key: str) -> tuple[str, str]:
    """(namespace, hash) of a store key."""
    name, sep, mm_hash = key.partition(NAMESPACE_SEP)
    return (name, mm_hash) if sep else ("", key)


def namespace_name(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The namespace a call's metadata names, checked ("" when none)."""
    for key, value in metadata or ():
        if key == NAMESPACE_KEY:
            name = value if isinstance(value, str) else value.decode("ascii", "replace")
            check_namespace(name)
            return name
    return ""


class Namespace:
    """One namespace: its store keys and its feed."""

    __slots__ = ("_prefix", "feed", "name")

    def __init__(self, name: str, feed: Feed) -> None:
        self.name = name
        self.feed = feed
        self._prefix = store_key(name, "")

    def key(self, mm_hash: str) -> str:
        return self._prefix + mm_hash

    def keys(self, mm_hashes: Iterable[str]) -> list[str]:
        prefix = self._prefix
        return [prefix + h for h in mm_hashes] if prefix else list(mm_hashes)

    def checked_keys(self, mm_hashes: Sequence[str]) -> list[str]:
        """The store keys of a request's hashes, each checked (InvalidArgumentError
        names what is wrong: too many, or a hash no server takes)."""
        check_count("mm_hashes", len(mm_hashes))
        for h in mm_hashes:
            check_name("mm_hash", h)
        return self.keys(mm_hashes)

    def owns(self, key: str) -> bool:
        return key.startswith(self._prefix) if self._prefix else NAMESPACE_SEP not in key

    def hashes(self, keys: Iterable[str]) -> list[str]:
        """The hashes of the keys this namespace owns, in order; others left out."""
        cut = len(self._prefix)
        return [k[cut:] for k in keys if self.owns(k)]


class Namespaces:
    """The namespaces in use, each made on first use, at most `max_namespaces`."""

    def __init__(
        self,
        instance_id: str,
        state: Callable[[], FeedState],
        pending: Callable[[], Sequence[str]],
        *,
        max_namespaces: int = ServerConfig.max_namespaces,
        ring_bytes: int = ServerConfig.feed_buffer_bytes,
        on_snapshot: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._instance_id = instance_id
        self._state = state
        self._pending = pending
        self._max = max_namespaces
        self._ring_bytes = ring_bytes
        self._on_snapshot = on_snapshot
        self._changes = 0  # every namespace's, together: where a new feed starts
        self._clock = clock
        self._next_scan = 0.0
        self._all: dict[str, Namespace] = {}
        self._closed = False
        self.default = self._make("")

    def __len__(self) -> int:
        return len(self._all)

    @property
    def subscribers(self) -> int:
        return sum(ns.feed.subscribers for ns in self._all.values())

    def of_call(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Namespace:
        """The namespace a call names in its metadata."""
        return self.get(namespace_name(metadata))

    def get(self, name: str) -> Namespace:
        """The namespace `name`, made if new; RESOURCE_EXHAUSTED past the bound."""
        found = self._all.get(name)
        if found is not None:
            return found
        if len(self._all) >= self._max and self._clock() >= self._next_scan:
            # A scan of every key: at most once a second, however many ask.
            self._next_scan = self._clock() + _SCAN_EVERY_S
            self._forget_idle()
        if len(self._all) >= self._max:
            raise ResourceExhaustedError(
                f"this server already holds {len(self._all)} namespaces with items or "
                f"subscribers, its limit (--max-namespaces); namespace {name!r} would be one "
                "more: reuse a namespace, or raise the limit"
            )
        return self._make(name)

    def changed(self, change: ItemChange) -> None:
        """The cache's change stream's subscriber: L1's changes, to the feeds."""
        if not change.in_l2:
            self.emit(change.kind, change.key, change.size)

    def emit(self, kind: Change, key: str, size: int = 0) -> None:
        """A change to L1's key set: to its namespace's feed."""
        self._changes += 1
        name, mm_hash = split_key(key)
        namespace = self._all.get(name) or self._make(name)  # it has items: never refused
        namespace.feed.emit(kind, mm_hash, size)

    def seq_of(self, namespace: Namespace) -> int:
        """The namespace's latest sequence number (from its feed now, should it
        have been forgotten and made again meanwhile)."""
        live = self._all.get(namespace.name)
        return (live or namespace).feed.seq

    def owned_by(self, namespace: Namespace) -> Callable[[str], bool] | None:
        """Which store keys are the namespace's; None when every key is."""
        return None if len(self._all) == 1 else namespace.owns

    def flush(self) -> None:
        for namespace in self._all.values():
            namespace.feed.flush()

    def close(self) -> None:
        """Close every feed, and each made from now on (see `Feed.close`)."""
        self._closed = True
        for namespace in self._all.values():
            namespace.feed.close()

    def _make(self, name: str) -> Namespace:
        feed = Feed(
            self._instance_id,
            lambda: self._state_of(namespace),
            ring_bytes=self._ring_bytes,
            on_snapshot=self._on_snapshot,
            start_seq=self._changes,
        )
        if self._closed:
            feed.close()
        namespace = Namespace(name, feed)
        self._all[name] = namespace
        return namespace

    def _state_of(self, namespace: Namespace) -> FeedState:
        state = self._state()
        if len(self._all) == 1:
            return state  # the only namespace: every key is its own
        owned = [
            (key, size)
            for key, size in zip(state.mm_hashes, state.sizes, strict=True)
            if namespace.owns(key)
        ]
        return FeedState(
            namespace.hashes(key for key, _ in owned),
            [size for _, size in owned],
            namespace.hashes(state.pending),
            state.capacity,
            state.max_items,
        )

    def _forget_idle(self) -> None:
        # A scan of every key, but only when the bound is met.
        state = self._state()
        live = {split_key(k)[0] for k in state.mm_hashes}
        live.update(split_key(k)[0] for k in self._pending())
        for name, namespace in list(self._all.items()):
            if name and name not in live and namespace.feed.idle:
                del self._all[name]
