"""Leases: promises that an item stays readable until its reader has read it.

A get_and_update that asks for leases takes one grant per entry it reports
held or stored; the engine's Fetch with `release` gives back one grant per
hash it reads, and a grant nobody gives back expires after `lease_s`. While a
hash has grants its entry is pinned in the LRU: it counts in the capacity but
is never evicted. Grants are counted per hash, not per caller, because an
engine knows only the hashes its frontend passed it (vLLM's P1 gets a hash and
None in place of the data); every grant lasts as long, so the oldest grant of
a hash is the first to expire and the one a read gives back.

No I/O and no clock of its own: the store passes `now`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

__all__ = ["LeaseBook"]


class LeaseBook:
    """Grants per hash, with expiry in grant order (all grants last `lease_s`)."""

    __slots__ = ("_by_key", "_count", "_lease_s", "_on_first", "_on_last", "_order")

    def __init__(
        self, lease_s: float, on_first: Callable[[str], bool], on_last: Callable[[str], None]
    ) -> None:
        self._lease_s = lease_s
        self._on_first = on_first
        self._on_last = on_last
        # Expiry times of each hash's grants, oldest first.
        self._by_key: dict[str, deque[float]] = {}
        # Every grant as (expiry, hash), in grant order = expiry order.
        self._order: deque[tuple[float, str]] = deque()
        self._count = 0

    @property
    def lease_s(self) -> float:
        return self._lease_s

    def __len__(self) -> int:
        """Grants outstanding."""
        return self._count

    def __contains__(self, key: object) -> bool:
        return key in self._by_key

    def grant(self, keys: Iterable[str], now: float) -> None:
        """One grant per key (a key named twice takes two)."""
        expiry = now + self._lease_s
        for key in keys:
            grants = self._by_key.get(key)
            if grants is None:
                if not self._on_first(key):
                    continue  # not held: nothing to promise
                grants = self._by_key[key] = deque()
            grants.append(expiry)
            self._order.append((expiry, key))
            self._count += 1

    def release(self, keys: Iterable[str]) -> int:
        """Give back the oldest grant of each key; how many were held."""
        released = 0
        for key in keys:
            grants = self._by_key.get(key)
            if grants is None:
                continue
            grants.popleft()
            released += 1
            self._drop_if_empty(key, grants)
        self._count -= released
        return released

    def expire(self, now: float) -> int:
        """Give back every grant past its expiry; how many there were."""
        expired = 0
        order = self._order
        while order and order[0][0] <= now:
            _, key = order.popleft()
            grants = self._by_key.get(key)
            # This grant may have been released already; then this pops the
            # next grant of the key only if that one has expired too.
            if grants and grants[0] <= now:
                grants.popleft()
                expired += 1
                self._drop_if_empty(key, grants)
        self._count -= expired
        return expired

    def forget(self, key: str) -> None:
        """Drop every grant of a key whose entry is gone (their reads will miss)."""
        grants = self._by_key.pop(key, None)
        if grants is not None:
            self._count -= len(grants)

    def _drop_if_empty(self, key: str, grants: deque[float]) -> None:
        if not grants:
            del self._by_key[key]
            self._on_last(key)
