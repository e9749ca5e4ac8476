"""What a co-located client tells its server after the fact, off the read's path.

A read of an item resident in the shared-memory region makes no call, so
what the server would have learnt from the call goes in a Release sent in
the background: the leases the read gives back, the holds it is done with
(of views, and of ReadShm's copies), and the bytes it read (for
mmcache_shm_bytes_total). One such call is
in flight at a time, and everything that piles up meanwhile goes in the
next. Best effort: a lease or a hold never given back ends by itself.

Any client reports the same way the queries it answered itself (misses it
neither looked up nor uploaded), so the server counts every query its
callers count.

A client that maps the region writes its reports in a report ring there
instead (mmcache._rings), once the server gave it one: no call at all, and
the server reads the ring before it next acts on its store. A report the
ring cannot take (full, retired, too large) goes by call as before.

Reports come from the client's event loop, and (`post`) from its callers'
own threads: the hits and reads it made there with no call
(colocated/_resident.py). A ring write takes the ring's lock; what the ring
cannot take is handed to the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable

from mmcache._errors import MMCacheError
from mmcache._spec import MAX_HASHES_PER_CALL, MAX_MODALITIES_PER_REPORT

from ..wire import Report, report_bytes
from ._shm import ClientRing

__all__ = ["Reports"]

_LOGGER = logging.getLogger(__name__)

MAX_PENDING = 4 * MAX_HASHES_PER_CALL
RING_RETRY_S = 30.0  # after a ring was refused or retired, reports go by call this long
_GONE_KEPT = 16  # the tokens of dropped regions remembered (one per restart)


class Reports:
    """Releases, holds done and bytes read, sent in the background by `send`."""

    def __init__(
        self,
        send: Callable[[Report], Awaitable[str]],
        answered: Callable[[str], None],
        open_ring: Callable[[bytes], Awaitable[ClientRing | None]] | None = None,
    ) -> None:
        self._send = send
        self._answered = answered  # with the instance id of each reply
        self._open_ring = open_ring
        self._ring: ClientRing | None = None
        self._ring_token = b""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._opening: asyncio.Task[None] | None = None
        self._no_ring_until = 0.0
        self._token = b""
        self._released: list[str] = []
        self._done: list[int] = []
        self._sending: list[int] = []  # the holds done in the Release in flight
        self._read_bytes = 0
        self._misses: Counter[str] = Counter()
        self._hits: Counter[str] = Counter()
        self._cpu_ns = 0
        self._task: asyncio.Task[None] | None = None
        self._gone: set[bytes] = set()  # tokens of regions dropped

    def add(
        self,
        token: bytes,
        *,
        released: Iterable[str] = (),
        done: Iterable[int] = (),
        read_bytes: int = 0,
    ) -> None:
        if token in self._gone:  # a region dropped: what it leased and held ended with it
            return
        if token != self._token:  # another region (a restarted server): its holds are gone
            self._forget_pending()
            self._token = token
        ring = self._ring_for(token)
        if ring is not None:
            released, done = list(released), list(done)
            report = Report(mm_hashes=released, shm_done=done, shm_read_bytes=read_bytes)
            if self._written(ring, report):
                return
        self._released.extend(released)
        self._done.extend(done)
        # A server out of reach for long: the oldest leases end by themselves.
        del self._released[:-MAX_PENDING]
        del self._done[:-MAX_PENDING]
        self._read_bytes += read_bytes
        self._start()

    def forget(self, token: bytes) -> None:
        """The region of `token` is dropped (its server restarted, or killed):
        nothing more goes to its ring, nor by call for its leases and holds
        (the server that took them is gone; another must not end its own)."""
        if len(self._gone) >= _GONE_KEPT:
            self._gone.clear()
        self._gone.add(token)
        if token == self._ring_token:
            self._ring, self._ring_token = None, b""
        if token == self._token:
            self._forget_pending()

    def _forget_pending(self) -> None:
        self._released.clear()
        self._done.clear()
        self._read_bytes = 0

    def add_queries(self, modalities: Iterable[str], *, hits: bool) -> None:
        """Queries answered here, one per modality named: misses, or `hits`."""
        counted = Counter(modalities)
        ring, report = self._ring, _queries_report(counted, hits)
        if ring is not None and report is not None and self._written(ring, report):
            return
        if hits:
            self._hits = _folded(self._hits + counted)
        else:
            self._misses = _folded(self._misses + counted)
        self._start()

    def post_queries(self, modalities: Iterable[str], *, hits: bool) -> bool:
        """`add_queries` from any thread, into the ring only: False where there
        is none, or it cannot take them (the caller uses `add_queries`)."""
        ring, report = self._ring, _queries_report(Counter(modalities), hits)
        # Not `_written`: retiring a ring is the loop's to do.
        return ring is not None and report is not None and ring.write(report_bytes(report))

    def ring(self, token: bytes) -> ClientRing | None:
        """The live report ring of the region of `token`, from any thread; None
        while there is none (`open` asks for one)."""
        ring = self._ring
        return ring if ring is not None and self._ring_token == token and ring.live() else None

    def open(self, token: bytes) -> None:
        """Ask for a ring in the region of `token` now, before the first report
        (a client that leases with no call needs one first)."""
        self._loop = asyncio.get_running_loop()
        self._gone.discard(token)  # mapped again (a server that stalled, then answered)
        if token != self._ring_token:  # a new region (a restarted server): ask at once
            self._no_ring_until = 0.0
        self._ring_for(token)

    def post(self, token: bytes, report: Report) -> None:
        """`add` from any thread: into the ring, or else to the loop, which sends it."""
        payload = report_bytes(report)
        if not payload:  # nothing to say; an empty record would say the client closed
            return
        ring = self.ring(token)
        if ring is not None and ring.write(payload):
            return
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # a loop closing meanwhile
                loop.call_soon_threadsafe(self._merge, token, report)

    def post_upload(self, token: bytes, header: bytes) -> bool:
        """An upload's header (every payload in a write slot) into the ring of
        the region of `token`, with no call; False when there is no ring or no
        room in it (the caller sends the upload by call)."""
        ring = self.ring(token)
        if ring is None or not ring.write(report_bytes(Report(upload=header))):
            return False
        ring.poke()  # the server reads it now (mmcache._wake), not at its next timer
        return True

    def _merge(self, token: bytes, report: Report) -> None:
        """On the loop: a report a caller's thread could not write in the ring."""
        self._hits = _folded(self._hits + Counter(report.hits))
        self._cpu_ns += report.client_cpu_ns
        self.add(
            token,
            released=report.mm_hashes,
            done=report.shm_done,
            read_bytes=report.shm_read_bytes,
        )
        self._start()  # the hits and CPU go by call (`add` may have used a ring)

    def _ring_for(self, token: bytes) -> ClientRing | None:
        """The report ring of the region of `token`; None while there is none
        (one is asked for on first use, and again RING_RETRY_S after a refusal)."""
        if self._ring is not None and token == self._ring_token:
            return self._ring
        if token and self._open_ring is not None and time.monotonic() >= self._no_ring_until:
            self._no_ring_until = time.monotonic() + RING_RETRY_S  # one try at a time
            self._opening = asyncio.get_running_loop().create_task(self._open(token))
        return None

    def _written(self, ring: ClientRing, report: Report) -> bool:
        """Whether `report` went in `ring`; one retired is dropped (by call, and another later)."""
        payload = report_bytes(report)
        if not payload:  # nothing to say; an empty record would say the client closed
            return True
        if ring.write(payload):
            return True
        if not ring.live():
            self._ring = None
            self._no_ring_until = time.monotonic() + RING_RETRY_S
        return False

    async def _open(self, token: bytes) -> None:
        assert self._open_ring is not None
        try:
            ring = await self._open_ring(token)
        except MMCacheError as exc:
            _LOGGER.debug("no report ring (reports go by call): %s", exc)
            return
        if ring is not None:
            self._ring, self._ring_token = ring, token
            ring.poke()  # first: the server knows this client pokes before its first post

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    def done(self, token: bytes) -> list[int]:
        """The holds done that the server may not have heard of yet (to send, or
        in the Release in flight), for a ReadShm to carry as well: the server
        ends them before serving it (ending one twice is harmless)."""
        if token != self._token:
            return []
        return [*self._sending, *self._done][-MAX_HASHES_PER_CALL:]

    async def _run(self) -> None:
        while (
            self._released
            or self._done
            or self._read_bytes
            or self._misses
            or self._hits
            or self._cpu_ns
        ):
            self._sending = self._done[:MAX_HASHES_PER_CALL]
            request = Report(
                mm_hashes=self._released[:MAX_HASHES_PER_CALL],
                shm_token=self._token,
                shm_read_bytes=self._read_bytes,
                shm_done=self._sending,
                misses=self._misses,
                hits=self._hits,
                client_cpu_ns=self._cpu_ns,
            )
            del self._released[:MAX_HASHES_PER_CALL]
            del self._done[:MAX_HASHES_PER_CALL]
            self._read_bytes = self._cpu_ns = 0
            self._misses, self._hits = Counter(), Counter()
            try:
                instance_id = await self._send(request)
            except MMCacheError as exc:
                _LOGGER.debug("could not report to the server (leases end by themselves): %s", exc)
            else:
                self._answered(instance_id)
            finally:
                self._sending = []

    async def flush(self, timeout: float) -> None:
        """Wait (at most `timeout` seconds) until everything added has been sent."""
        task = self._task
        if task is not None and not task.done():
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(task), timeout)

    def cancel(self) -> None:
        """At the client's close: nothing more is sent, and the ring goes back."""
        if self._ring is not None:
            self._ring.write(b"")  # an empty record: the server retires the ring
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if self._opening is not None:
            self._opening.cancel()
            self._opening = None
        self._ring = None


def _folded(counts: Counter[str]) -> Counter[str]:
    """Counts by modality within MAX_MODALITIES_PER_REPORT: the rest as unknown."""
    if len(counts) <= MAX_MODALITIES_PER_REPORT:
        return counts
    kept = Counter(dict(counts.most_common(MAX_MODALITIES_PER_REPORT - 1)))
    kept[""] += counts.total() - kept.total()
    return kept


def _queries_report(counted: Counter[str], hits: bool) -> Report | None:
    """Queries as one report: None where their modalities do not fit in one."""
    if len(counted) > MAX_MODALITIES_PER_REPORT:
        return None
    return Report(hits=counted) if hits else Report(misses=counted)
