"""The P0 mirror: the server's keys and sizes, never tensor data.

It runs the same `ByteLRU` batch rule as the server on the same sizes, so for
one client it predicts every hit and miss exactly. Where it is wrong (other
clients, a restart, concurrent calls reaching the server in another order)
the server's reply is the truth: `reconcile` adopts it.
"""

from __future__ import annotations

from collections.abc import Sequence

from mmcache._lru import BatchEntry, ByteLRU, Outcome

__all__ = ["Mirror"]


class Mirror:
    def __init__(self, instance_id: str, capacity: int, max_items: int = 0) -> None:
        self.instance_id = instance_id
        self._lru: ByteLRU[None] = ByteLRU(capacity, max_items=max_items or None)
        self._touched: list[str] = []

    @property
    def capacity(self) -> int:
        return self._lru.capacity

    @property
    def used(self) -> int:
        return self._lru.used

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, mm_hash: object) -> bool:
        return mm_hash in self._lru

    def keys(self) -> list[str]:
        """Keys from least to most recently used."""
        return list(self._lru.keys())

    def touch(self, mm_hash: str) -> None:
        """Touch locally now; the server gets the touch with the next batch."""
        if self._lru.touch(mm_hash):
            self._touched.append(mm_hash)

    def take_touches(self) -> list[str]:
        touched, self._touched = self._touched, []
        return touched

    def plan(self, hashes: Sequence[str], sizes: Sequence[int | None]) -> list[Outcome]:
        """Predict the server's outcome of a batch, and apply it here.

        A size of None is an entry with no data at hand (hash only).
        HIT: send the hash only; STORED/UNCACHED: send the data; MISSING:
        no data at hand and not held.
        """
        return self._lru.apply_batch(
            [BatchEntry(h, s) for h, s in zip(hashes, sizes, strict=True)],
            replace_present=False,
        )

    def reconcile(
        self,
        instance_id: str,
        capacity: int,
        max_items: int,
        hashes: Sequence[str],
        outcomes: Sequence[Outcome],
        sizes: Sequence[int],
    ) -> None:
        """Make the mirror agree with what the server reported for a batch.

        `max_items` 0 is a server without an item bound.
        """
        bound = max_items or None
        if instance_id != self.instance_id:
            # A new server process (a restart): it holds only what this
            # batch just put there, if anything.
            self.instance_id = instance_id
            self._lru = ByteLRU(capacity, max_items=bound)
            self._touched.clear()
        elif capacity != self._lru.capacity or bound != self._lru.max_items:
            self._lru.resize(capacity, bound)
        for mm_hash, outcome, size in zip(hashes, outcomes, sizes, strict=True):
            if outcome in (Outcome.MISSING, Outcome.UNCACHED):
                self._lru.pop(mm_hash)
            elif self._lru.size_of(mm_hash) != size:
                self._lru.put(mm_hash, None, size)

    def forget(self, mm_hashes: Sequence[str]) -> None:
        for mm_hash in mm_hashes:
            self._lru.pop(mm_hash)

    def clear(self) -> None:
        self._lru.clear()
        self._touched.clear()
