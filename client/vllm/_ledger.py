"""P0's per-request ledger: what one request's calls share.

vLLM asks its P0 cache, per request and on one thread of its pool,
`is_cached`, then `get_and_update_item` item by item, then (0.32 and later)
`release_sender_touches`. A `Ledger` is what those calls leave for the next
ones: what the sidecar confirmed, what this process's own cache answered,
what goes up when the request ends, and what the server has not been told.
`Ledgers` keeps one per thread: requests run on a thread pool, one per
thread at a time.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from vllm.multimodal.inputs import MultiModalKwargsItem

__all__ = ["Ledger", "Ledgers", "Upload"]

# One item to share: (hash, modality, item, prompt updates).
Upload = tuple[str, str, MultiModalKwargsItem, Any]


@dataclass
class Ledger:
    """What one request's calls share, from is_cached to release_sender_touches."""

    started: bool = False  # by is_cached: release_sender_touches will end it
    confirmed: dict[str, Any] = field(default_factory=dict)  # hash -> prompt updates
    looked_up: set[str] = field(default_factory=set)
    uploads: list[Upload] = field(default_factory=list)
    held_elsewhere: set[str] = field(default_factory=set)  # held, updates not usable here
    processed: int = 0  # items that came with data (misses)
    # Hits of this process's own cache: hash -> (item, updates), taken when
    # is_cached answered (another request may evict it before vLLM takes it).
    local: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    unshared: set[str] = field(default_factory=set)  # local hits the sidecar lacks
    # Small images this request keeps here, as vLLM alone would (_small.py):
    # decided once, at is_cached, so what the request learns meanwhile does
    # not leave a claim it made without its upload.
    kept: set[str] = field(default_factory=set)
    # Sidecar hits this process's cache lacked: the data read for it.
    filled: dict[str, MultiModalKwargsItem] = field(default_factory=dict)
    # Sidecar hits this process's cache held at is_cached: its entry, put
    # back if the request's own misses evict it before vLLM takes it.
    here: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    # Sidecar hits leased for the engine's read (those resident in its shared
    # memory too), and the small ones of `filled` whose data goes inline
    # instead (their leases given back).
    leased: set[str] = field(default_factory=set)
    resident: set[str] = field(default_factory=set)
    inline: set[str] = field(default_factory=set)
    # Modalities of misses the server has not counted yet: processed items
    # neither looked up nor uploaded (sent with the request's uploads).
    misses: list[str] = field(default_factory=list)
    # Modalities of this process's own hits no call told the server of (the
    # server counts them as vLLM does, from the next report), and the hashes
    # of those offered to the sidecar again (re-sends there, not queries).
    own_hits: list[str] = field(default_factory=list)
    offered: set[str] = field(default_factory=set)
    merged: bool = False  # vLLM has taken its items (get_and_update_item)
    observed: bool = False  # its processing time was measured
    # (wall, this thread's CPU) when is_cached last answered (the processor
    # starts then), and when the first processed item came back.
    asked: tuple[float, float] = (0.0, 0.0)
    first_back: tuple[float, float] = (0.0, 0.0)

    def is_hit(self, mm_hash: str) -> bool:
        """Confirmed by the sidecar, or held by this process's own cache."""
        return mm_hash in self.confirmed or mm_hash in self.local

    def counted(self, mm_hash: str) -> bool:
        """The server counted the item's query already: looked up, or a hit
        of this process's own offered again."""
        return mm_hash in self.looked_up or mm_hash in self.offered


class Ledgers:
    """Each thread's request in progress."""

    def __init__(self) -> None:
        self._local = threading.local()

    def current(self) -> Ledger:
        """This thread's request's ledger (a new one if none is in progress)."""
        ledger: Ledger | None = getattr(self._local, "ledger", None)
        if ledger is None:
            ledger = self._local.ledger = Ledger()
        return ledger

    def end(self) -> Ledger:
        """This thread's request ends: its ledger, the next call beginning another."""
        ledger = self.current()
        self._local.ledger = None
        return ledger
