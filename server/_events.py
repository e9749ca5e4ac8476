"""Item events for routers: what this sidecar holds, published on a ZMQ PUB
socket in vLLM's KV-event framing (docs/l2.md).

Each message is three frames, as vLLM's `ZmqEventPublisher` sends its KV
events: the topic, the batch's sequence number (8 bytes, big-endian), and the
batch, msgpack-encoded as an array `[ts, events, instance_id]` whose events
are tagged arrays:

    ["ItemStored", mm_hashes, sizes, tier, namespace]
    ["ItemRemoved", mm_hashes, tier, namespace]
    ["AllCleared", instance_id]

`tier` is "l1" (this sidecar's cache) or "l2" (this sidecar wrote the item to
the fleet's L2 tier; L2's own evictions are not seen, so routers age those
out). Sizes are the bytes charged for each item. A sidecar publishes
AllCleared when it starts: a router drops what it knew of an earlier
instance. Changes are batched for `flush_s` (10 ms). A subscriber that sees a
gap in the numbers asks the replay socket (ROUTER; a REQ sends the first
number it lacks as 8 bytes) and gets each buffered batch from that number on
as [seq, batch], then [-1, b""]: vLLM's replay protocol. These are not KV
blocks: nothing here pretends to be a BlockStored.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque

import msgspec
import zmq
import zmq.asyncio

from ._namespaces import split_key
from .cache import Change, ItemChange

__all__ = [
    "END_SEQ",
    "AllCleared",
    "ItemEventBatch",
    "ItemEvents",
    "ItemRemoved",
    "ItemStored",
]

_LOGGER = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MAX_BATCH_EVENTS = 4096  # changes in one message: sent at once when reached
REPLAY_S = 10.0  # the longest one replay may take: a client that stops reading


class ItemStored(msgspec.Struct, array_like=True, gc=False, tag=True):
    mm_hashes: list[str]
    sizes: list[int]
    tier: str
    namespace: str


class ItemRemoved(msgspec.Struct, array_like=True, gc=False, tag=True):
    mm_hashes: list[str]
    tier: str
    namespace: str


class AllCleared(msgspec.Struct, array_like=True, gc=False, tag=True):
    instance_id: str


ItemEvent = ItemStored | ItemRemoved | AllCleared


class ItemEventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[ItemEvent]
    instance_id: str


class ItemEvents:
    """The publisher: bind with `start()`, feed it the store's changes."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        topic: str,
        instance_id: str,
        *,
        buffer_batches: int = 10_000,
        buffer_bytes: int = 64 << 20,
        flush_s: float = 0.01,
    ) -> None:
        self._endpoint = endpoint
        self._replay_endpoint = replay_endpoint
        self._topic = topic.encode()
        self._instance_id = instance_id
        self._flush_s = flush_s
        self._encoder = msgspec.msgpack.Encoder()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._buffered = 0  # bytes in the buffer, at most buffer_bytes
        self._buffer_bytes = buffer_bytes
        self._seq = 0
        # Changes not yet sent: (kind, namespace, tier, hash, size), in order.
        self._pending: list[tuple[str, str, str, str, int]] = []
        self._context: zmq.asyncio.Context | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.endpoints: tuple[str, str | None] = (endpoint, replay_endpoint)

    def start(self) -> None:
        """Bind the sockets (OSError when an endpoint cannot be bound) and
        publish AllCleared for this new instance."""
        context = self._context = zmq.asyncio.Context()
        try:
            self._pub = context.socket(zmq.PUB)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.bind(self._endpoint)
            pub_at = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            replay_at = None
            if self._replay_endpoint is not None:
                self._replay = context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                # Past a slow reader's high-water mark a ROUTER drops what it
                # sends, silently: a replay would skip batches and still end
                # with the end marker. Mandatory: the send waits instead.
                self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
                self._replay.bind(self._replay_endpoint)
                replay_at = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise OSError(f"cannot publish item events on {self._endpoint}: {exc}") from None
        self.endpoints = (pub_at, replay_at)
        self._send([AllCleared(self._instance_id)])
        self._tasks.append(asyncio.create_task(self._flusher()))
        if self._replay is not None:
            self._tasks.append(asyncio.create_task(self._serve_replay(self._replay)))
        _LOGGER.info("item events on %s (replay %s), topic %r", pub_at, replay_at, self._topic)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        self._flush()
        self._close_sockets()

    def changed(self, change: ItemChange) -> None:
        """The cache's change stream's subscriber: stored or removed, in L1;
        written to L2."""
        tier = "l2" if change.in_l2 else "l1"
        if change.kind == Change.STORED:
            self._add("stored", change.key, tier, change.size)
        elif change.kind == Change.REMOVED:
            self._add("removed", change.key, tier, 0)

    def _add(self, kind: str, key: str, tier: str, size: int) -> None:
        if self._pub is None:
            return
        namespace, mm_hash = split_key(key)
        self._pending.append((kind, namespace, tier, mm_hash, size))
        if len(self._pending) >= MAX_BATCH_EVENTS:
            self._flush()
        else:
            self._wake.set()

    async def _flusher(self) -> None:
        while True:
            await self._wake.wait()
            await asyncio.sleep(self._flush_s)  # what else comes meanwhile joins the batch
            self._wake.clear()
            self._flush()

    def _flush(self) -> None:
        if self._pending:
            pending, self._pending = self._pending, []
            self._send(_events_of(pending))

    def _send(self, events: list[ItemEvent]) -> None:
        if self._pub is None:
            return
        payload = self._encoder.encode(ItemEventBatch(time.time(), events, self._instance_id))
        seq = self._seq
        self._seq += 1
        if len(self._buffer) == self._buffer.maxlen:
            self._buffered -= len(self._buffer[0][1])
        self._buffer.append((seq, payload))
        self._buffered += len(payload)
        while self._buffered > self._buffer_bytes and len(self._buffer) > 1:
            self._buffered -= len(self._buffer.popleft()[1])
        # A PUB socket never blocks: past its high-water mark a slow
        # subscriber's messages are dropped, and it replays the gap.
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart(
                [self._topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK
            )

    async def _serve_replay(self, replay: zmq.asyncio.Socket) -> None:
        while True:
            try:
                await self._replay_once(replay)
            except zmq.ZMQError as exc:  # one subscriber's trouble ends no replay
                _LOGGER.warning("item-event replay failed: %s", exc)

    async def _replay_once(self, replay: zmq.asyncio.Socket) -> None:
        frames = await replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            _LOGGER.debug("replay request of %d frames ignored", len(frames))
            return
        client, _, start = frames
        try:  # a client that stops reading holds up the next replay this long at most
            await asyncio.wait_for(self._replay_to(replay, client, start), REPLAY_S)
        except TimeoutError:  # no end marker: the client knows it is incomplete
            _LOGGER.warning("item-event replay abandoned: not taken within %.0fs", REPLAY_S)

    async def _replay_to(self, replay: zmq.asyncio.Socket, client: bytes, start: bytes) -> None:
        first, empty = int.from_bytes(start, "big"), b""
        for seq, payload in list(self._buffer):
            if seq >= first:
                await replay.send_multipart([client, empty, seq.to_bytes(8, "big"), payload])
        await replay.send_multipart([client, empty, END_SEQ, b""])

    def _close_sockets(self) -> None:
        for socket in (self._pub, self._replay):
            if socket is not None:
                socket.close(linger=0)
        self._pub = self._replay = None
        if self._context is not None:
            self._context.term()
            self._context = None


def _events_of(pending: list[tuple[str, str, str, str, int]]) -> list[ItemEvent]:
    """Runs of changes of one kind, namespace and tier, as one event each."""
    events: list[ItemEvent] = []
    run: ItemStored | ItemRemoved | None = None
    last = None
    for kind, namespace, tier, mm_hash, size in pending:
        if run is None or (kind, namespace, tier) != last:
            last = (kind, namespace, tier)
            run = (
                ItemStored([], [], tier, namespace)
                if kind == "stored"
                else ItemRemoved([], tier, namespace)
            )
            events.append(run)
        run.mm_hashes.append(mm_hash)
        if isinstance(run, ItemStored):
            run.sizes.append(size)
    return events
