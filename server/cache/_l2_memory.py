"""An L2 tier in this process's memory: the `L2Backend` interface with the
Redis backend's semantics (records whole or absent, TTLs, an LRU bound as
`allkeys-lru` gives, claims, heartbeats, want lists), for caches in one
process: the data plane's tests without Redis, and a development setup
where several `ItemCache`s stand for a fleet.

Nothing is shared between processes. `fail` makes every operation raise
L2Error until `heal`, as an unreachable store would. `--l2 memory://NAME`
gives every sidecar of one process that names NAME the same one
(`shared_memory_l2`): the protocol's fleet tests run on it, and a fleet can
be tried without Redis, in one process.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from ._l2 import L2Error, L2Record, Poll, Sighting, Want

__all__ = ["MemoryL2", "is_memory_url", "shared_memory_l2"]

MEMORY_SCHEME = "memory://"

_WANTS_KEPT = 4096  # as the Redis backend trims a want list


@dataclass
class _Claim:
    owner: str
    asked: int  # other nodes that asked
    until: float


class MemoryL2:
    """An `L2Backend` in memory, at most `max_bytes` of records (the least
    recently read or written go first).

        backend = MemoryL2(max_bytes=256 << 20)
        tier = L2Tier(backend, store, metrics, L2Settings(), WIRE_MANIFESTS)  # server/_records.py
    """

    def __init__(
        self, max_bytes: int = 1 << 30, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._max_bytes = max_bytes
        self._clock = clock
        self._records: OrderedDict[str, tuple[L2Record, float | None]] = OrderedDict()
        self._bytes = 0
        self._claims: dict[str, _Claim] = {}
        self._alive: dict[str, float] = {}
        self._wants: dict[str, deque[str]] = {}
        self._failure: str | None = None
        self._closed = asyncio.Event()

    # -- state --

    @property
    def where(self) -> str:
        return "memory"

    @property
    def up(self) -> bool:
        return self._failure is None

    @property
    def nodes_down(self) -> int:
        return 0 if self._failure is None else 1

    @property
    def stored_bytes(self) -> int:
        return self._bytes

    def fail(self, reason: str = "down") -> None:
        """Every operation raises L2Error(reason) from now until `heal`."""
        self._failure = reason

    def heal(self) -> None:
        self._failure = None

    # -- records --

    async def watch(self) -> None:
        await self._closed.wait()

    async def read(self, key: str) -> L2Record | None:
        self._check()
        found = self._live(key)
        if found is None:
            return None
        self._records.move_to_end(key)
        return found

    async def holds(self, key: str) -> bool:
        self._check()
        return self._live(key) is not None

    async def write(self, key: str, record: L2Record, ttl_s: float) -> None:
        self._check()
        self._drop(key)
        until = self._clock() + ttl_s if ttl_s > 0 else None
        self._records[key] = (record, until)
        self._bytes += record.nbytes
        while self._bytes > self._max_bytes and self._records:
            self._drop(next(iter(self._records)))

    # -- claims --

    async def sight(self, key: str, window_s: float, node: str) -> tuple[Sighting, str]:
        self._check()
        claim = self._claim(key)
        if claim is None:
            self._claims[key] = _Claim(node, 0, self._clock() + window_s)
            return Sighting.FIRST, node
        if claim.owner == node:
            return Sighting.MINE, node
        claim.asked += 1
        return Sighting.OTHERS, claim.owner

    async def hold(self, key: str, node: str, hold_s: float) -> tuple[Sighting, int]:
        self._check()
        claim = self._claim(key)
        if claim is None:
            self._claims[key] = _Claim(node, 0, self._clock() + hold_s)
            return Sighting.FIRST, 0
        if claim.owner == node:
            claim.until = self._clock() + hold_s
            return Sighting.MINE, claim.asked
        claim.asked += 1
        return Sighting.OTHERS, claim.asked

    async def take_over(self, key: str, dead: str, node: str, window_s: float) -> bool:
        self._check()
        claim = self._claim(key)
        if claim is None or claim.owner != dead:
            return False
        self._claims[key] = _Claim(node, 0, self._clock() + window_s)
        return True

    async def unclaim(self, key: str, node: str) -> None:
        self._check()
        claim = self._claim(key)
        if claim is not None and claim.owner == node:
            del self._claims[key]

    async def poll(self, key: str) -> Poll:
        self._check()
        if self._live(key) is not None:
            return Poll.HELD
        return Poll.CLAIMED if self._claim(key) is not None else Poll.GONE

    # -- nodes --

    async def want(self, owner: str, key: str) -> Want:
        self._check()
        if self._alive.get(owner, 0.0) <= self._clock():
            return Want.OWNER_GONE
        wants = self._wants.setdefault(owner, deque(maxlen=_WANTS_KEPT))
        wants.append(key)
        return Want.ASKED

    async def beat(self, node: str, alive_s: float, most: int) -> list[str]:
        self._check()
        self._alive[node] = self._clock() + alive_s
        wants = self._wants.get(node)
        taken: list[str] = []
        while wants and len(taken) < most:
            taken.append(wants.popleft())
        return taken

    async def leave(self, node: str) -> None:
        self._check()
        self._alive.pop(node, None)
        self._wants.pop(node, None)

    async def close(self) -> None:
        self._closed.set()

    # -- helpers --

    def _check(self) -> None:
        if self._failure is not None:
            raise L2Error(f"memory: {self._failure}")

    def _live(self, key: str) -> L2Record | None:
        found = self._records.get(key)
        if found is None:
            return None
        record, until = found
        if until is not None and until <= self._clock():
            self._drop(key)
            return None
        return record

    def _claim(self, key: str) -> _Claim | None:
        claim = self._claims.get(key)
        if claim is not None and claim.until <= self._clock():
            del self._claims[key]
            return None
        return claim

    def _drop(self, key: str) -> None:
        found = self._records.pop(key, None)
        if found is not None:
            self._bytes -= found[0].nbytes


# Held by the tiers that use them: one no sidecar uses any more is freed.
_SHARED: weakref.WeakValueDictionary[str, MemoryL2] = weakref.WeakValueDictionary()


def is_memory_url(url: str) -> bool:
    return url.startswith(MEMORY_SCHEME)


def shared_memory_l2(url: str) -> MemoryL2:
    """The process's in-memory L2 named by `url` (memory://NAME), made on first use."""
    name = url.removeprefix(MEMORY_SCHEME)
    if not name or "/" in name:
        raise ValueError("memory:// takes a name, e.g. memory://fleet (sidecars in one process)")
    found = _SHARED.get(name)
    if found is None:
        found = _SHARED[name] = MemoryL2()
    return found
