"""The mirror feed: the store's changes, pushed to every subscribed client.

Every change (an item stored or removed, an upload begun or ended) takes the
next sequence number. Changes are batched for `flush_s` (a few ms), and at
least `gap_s` (50 ms) from the last message, into one serialised
`FeedMessage`, kept in one ring of recent messages that every subscriber
reads through a cursor of its own: a change costs one serialisation and one
copy in memory however many subscribe.

A subscriber starts with a snapshot of the whole key set at some sequence
number, then reads the ring from there. One that falls so far behind that the
ring (`ring_bytes`) has dropped messages it has not read gets a snapshot
again: a slow reader costs a resync, never unbounded memory. A snapshot is
built once and shared by every subscriber that can go on from it (the ring
still holds the messages after it), so a hundred subscribers resyncing at
once cost one snapshot.

A subscriber that asks for a longer gap than the feed's (a process whose
hits do not need a fresh mirror, woken by each message) gets, at most once
per gap, every message the ring gained meanwhile as one: serialised
messages concatenated parse as one message whose changes are theirs in
order and whose `seq` is the last (protobuf merges repeated fields and a
submessage met twice), so merging costs a join of bytes, no parse.

Transport-free: the gRPC handler writes what `Subscriber.messages` yields.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from mmcache._spec import MAX_FEED_GAP_S
from mmcache.v1 import cache_pb2 as pb

from ._config import ServerConfig
from .cache import Change, FeedState

__all__ = ["Feed", "FeedState", "Subscriber"]

# Changes per message, and keys per snapshot part: ~0.5-1 MiB each for
# 64-character hashes, well inside the 8 MiB message cap.
MAX_CHANGES_PER_MESSAGE = 8192
SNAPSHOT_PART_KEYS = 8192
# The least time between two messages: a busy feed wakes each subscriber at
# most 1 / GAP_S times a second, however many changes come. Each message
# wakes every subscriber's process (about 0.25 ms of its CPU here, on a
# cold cache), which with four vLLM API servers cost more than their new
# small images' uploads; a change after a quiet spell still goes within
# `flush_s`, a change in a busy one within GAP_S.
GAP_S = 0.05
# A subscriber may ask for a longer gap of its own (SubscribeRequest.gap_ms),
# capped at MAX_FEED_GAP_S so that its mirror is never further behind.
# What one message of a subscriber's own gap joins at most (a ring message
# larger than this, itself about 1 MiB at most, goes alone): well under the
# 8 MiB message cap. More waiting goes at once in further messages.
MERGED_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class _Snapshot:
    seq: int
    parts: tuple[bytes, ...]


class Feed:
    """Sequence numbers, batching, the ring of recent batches, and snapshots."""

    def __init__(
        self,
        instance_id: str,
        state: Callable[[], FeedState],
        *,
        flush_s: float = 0.01,
        gap_s: float = GAP_S,
        ring_bytes: int = ServerConfig.feed_buffer_bytes,
        on_snapshot: Callable[[str], None] | None = None,
        start_seq: int = 0,
    ) -> None:
        self._instance_id = instance_id
        self._state = state
        self._flush_s = flush_s
        self._gap_s = gap_s
        self._flushed = -gap_s  # when the last message was made (monotonic)
        self._ring_bytes = ring_bytes
        self._on_snapshot = on_snapshot
        self._seq = start_seq
        self._kinds: list[pb.ChangeKind.ValueType] = []
        self._hashes: list[str] = []
        self._sizes: list[int] = []
        self._flush_handle: asyncio.TimerHandle | None = None
        # The ring: (first seq, last seq, message), oldest first;
        # `_base` is the absolute index of its first message.
        self._ring: deque[tuple[int, int, bytes]] = deque()
        self._ring_used = 0
        self._base = 0
        self._snapshot: _Snapshot | None = None
        self._building: asyncio.Lock = asyncio.Lock()
        self._subscribers: set[Subscriber] = set()
        self._closed = False

    @property
    def seq(self) -> int:
        """The sequence number of the latest change."""
        return self._seq

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

    @property
    def idle(self) -> bool:
        """No subscriber, and nothing batched for one."""
        return not self._subscribers and not self._kinds

    def emit(self, kind: Change, mm_hash: str, size: int = 0) -> None:
        """Record one change; subscribers get it with the next batch."""
        self._seq += 1
        if not self._subscribers:
            # Nobody listens: only the number moves on, and any snapshot or
            # ring content is now stale for a newcomer.
            if self._snapshot is not None or self._ring:
                self._snapshot = None
                self._drop_ring()
            return
        self._kinds.append(pb.ChangeKind.ValueType(kind))  # the same numbers
        self._hashes.append(mm_hash)
        self._sizes.append(size)
        if len(self._kinds) >= MAX_CHANGES_PER_MESSAGE:
            self.flush()
        elif self._flush_handle is None:
            wait = max(self._flush_s, self._flushed + self._gap_s - time.monotonic())
            self._flush_handle = asyncio.get_running_loop().call_later(wait, self.flush)

    def flush(self) -> None:
        """Put the changes recorded so far in the ring as one message."""
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        if not self._kinds:
            return
        self._flushed = time.monotonic()
        message = pb.FeedMessage(
            instance_id=self._instance_id,
            seq=self._seq,
            changes=pb.FeedChanges(kinds=self._kinds, mm_hashes=self._hashes, sizes=self._sizes),
        ).SerializeToString()
        first = self._seq - len(self._kinds) + 1
        self._kinds, self._hashes, self._sizes = [], [], []
        self._ring.append((first, self._seq, message))
        self._ring_used += len(message)
        while self._ring_used > self._ring_bytes and len(self._ring) > 1:
            _, _, dropped = self._ring.popleft()
            self._ring_used -= len(dropped)
            self._base += 1
        snapshot = self._snapshot
        if snapshot is not None and self._ring[0][0] > snapshot.seq + 1:
            self._snapshot = None  # nobody can go on from it any more: free it
        for subscriber in self._subscribers:
            subscriber.wake()

    def subscribe(self, gap_s: float = 0.0) -> Subscriber:
        """A new subscriber; iterate `messages()` to send its feed. `gap_s`:
        the least time it wants between two messages of changes (the feed's
        own where less; at most MAX_FEED_GAP_S)."""
        subscriber = Subscriber(self, min(gap_s, MAX_FEED_GAP_S) if gap_s > self._gap_s else 0.0)
        self._subscribers.add(subscriber)
        return subscriber

    def close(self) -> None:
        """End every subscriber's messages, and those of any that comes later.

        For a stopping server: the Subscribe calls return normally at once,
        so a server stopping with followers has no call to wait out its
        grace for (the followers subscribe again, to the next instance).
        """
        self._closed = True
        for subscriber in self._subscribers:
            subscriber.end()

    def unsubscribe(self, subscriber: Subscriber) -> None:
        self._subscribers.discard(subscriber)
        if not self._subscribers:
            self.flush()

    def _drop_ring(self) -> None:
        self._base += len(self._ring)
        self._ring.clear()
        self._ring_used = 0

    def _end(self) -> int:
        return self._base + len(self._ring)

    def _index_after(self, seq: int) -> int | None:
        """The index of the first message with changes past `seq`, or None when
        the ring no longer holds every change past it."""
        if not self._ring:
            return self._end()  # whatever came after is still being batched
        if self._ring[0][0] > seq + 1:
            return None
        for offset, (_, last, _) in enumerate(self._ring):
            if last > seq:
                return self._base + offset
        return self._end()

    async def snapshot_for(self, subscriber: Subscriber, reason: str) -> tuple[bytes, ...]:
        """A snapshot the subscriber can go on from, and its cursor set after it."""
        async with self._building:
            snapshot = self._snapshot
            start = None if snapshot is None else self._index_after(snapshot.seq)
            while snapshot is None or start is None:
                # Built in parts with the loop free between them: if the ring
                # dropped what follows it meanwhile, build again.
                snapshot = await self._build()
                start = self._index_after(snapshot.seq)
            subscriber.cursor = start
            if self._on_snapshot is not None:
                self._on_snapshot(reason)
            return snapshot.parts

    async def _build(self) -> _Snapshot:
        # Captured in one step: the changes recorded but not yet flushed are
        # in the state, and the client skips changes at or below its number.
        state = self._state()
        seq = self._seq
        parts: list[bytes] = []
        n = len(state.mm_hashes)
        for start in range(0, max(n, 1), SNAPSHOT_PART_KEYS):
            end = min(n, start + SNAPSHOT_PART_KEYS)
            part = pb.FeedSnapshot(
                mm_hashes=state.mm_hashes[start:end],
                sizes=state.sizes[start:end],
                last=end >= n,
                capacity_bytes=state.capacity,
                max_items=state.max_items,
            )
            if start == 0:
                part.pending.extend(state.pending)
            parts.append(
                pb.FeedMessage(
                    instance_id=self._instance_id, seq=seq, snapshot=part
                ).SerializeToString()
            )
            await asyncio.sleep(0)  # a large snapshot does not stall other calls
        self._snapshot = _Snapshot(seq, tuple(parts))
        return self._snapshot


class Subscriber:
    """One client's feed: a snapshot, then the ring from its cursor on."""

    __slots__ = ("_event", "_feed", "_gap_s", "_resting", "cursor")

    def __init__(self, feed: Feed, gap_s: float = 0.0) -> None:
        self._feed = feed
        self._event = asyncio.Event()
        self._gap_s = gap_s  # its own gap between messages (0: the feed's)
        self._resting = False  # within its gap: new messages wake it not
        self.cursor = 0

    def wake(self) -> None:
        if not self._resting:
            self._event.set()

    def end(self) -> None:
        """The feed closed: wake it, even within its gap."""
        self._resting = False
        self._event.set()

    async def messages(self) -> AsyncIterator[bytes]:
        """Serialised FeedMessages, until the call ends or the feed closes."""
        feed = self._feed
        reason = "subscribe"
        while not feed._closed:
            for part in await feed.snapshot_for(self, reason):
                yield part
            yield pb.FeedMessage(instance_id=feed._instance_id, seq=feed.seq).SerializeToString()
            reason = "lag"
            # Else the ring dropped what it needs (a snapshot again), or the feed closed.
            while self.cursor >= feed._base and not feed._closed:
                if self.cursor < feed._end():
                    message, capped = self._next()
                    yield message
                    if self._gap_s and not capped:  # (what the cap left goes at once)
                        await self._rest()
                    continue
                self._event.clear()
                await self._event.wait()

    def _next(self) -> tuple[bytes, bool]:
        """The ring's message at the cursor; with a gap of its own, every one
        from there on joined into one, and whether MERGED_BYTES left some."""
        feed = self._feed
        start = self.cursor - feed._base
        if not self._gap_s:
            self.cursor += 1
            return feed._ring[start][2], False
        parts: list[bytes] = []
        size = 0
        for index in range(start, len(feed._ring)):  # (near its end: indexing is cheap)
            message = feed._ring[index][2]
            if parts and size + len(message) > MERGED_BYTES:
                break
            parts.append(message)
            size += len(message)
        self.cursor += len(parts)
        joined = parts[0] if len(parts) == 1 else b"".join(parts)
        return joined, start + len(parts) < len(feed._ring)

    async def _rest(self) -> None:
        """Let this subscriber's gap pass from the message just sent; the
        feed's close ends it at once (one while the message was written too)."""
        if self._feed._closed:
            return
        self._resting = True
        self._event.clear()
        timer = asyncio.get_running_loop().call_later(self._gap_s, self._event.set)
        try:
            await self._event.wait()
        finally:
            timer.cancel()
            self._resting = False
