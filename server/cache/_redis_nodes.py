"""Routing for the L2 tier's Redis Cluster: the slot map, one connection pool
per master, and a breaker per master. The commands are server/cache/_l2_redis.py's.

Why not redis-py's asyncio `RedisCluster`: it turns one node's connection
error into a reinitialisation shared by every node, and closes every node's
connections on CLUSTERDOWN, while other calls are using them. Under concurrent
traffic, a master killed and restarted keeps about two in three operations
failing on masters that never died for as long as the traffic runs (seen with
redis-py 8.1.0). Here a failure stays with its node: its pool is dropped, its
breaker opens, so calls on its slots miss at once instead of each waiting the
timeout, and a background probe (PING, at a backoff doubling to `most_s`)
closes it once the node answers. The slot map is loaded once at start, and
again from a live node while a node is down (to follow a failover) and after
a MOVED reply (to follow a resharding).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple, TypeVar

from redis.asyncio import Redis
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot
from redis.exceptions import ClusterDownError, MovedError, RedisError, ResponseError

from mmcache._breaker import Breaker

from ._l2 import L2Error
from ._resp_reads import BulkReader

__all__ = ["RedisNodes"]

_LOGGER = logging.getLogger(__name__)

T = TypeVar("T")


class NodeClients(NamedTuple):
    """A master's two clients: redis-py for commands, and one for big reads."""

    commands: Redis
    reads: BulkReader


Connect = Callable[[str, int], NodeClients]


@dataclass(eq=False)
class _Node:
    host: str
    port: int
    clients: NodeClients
    breaker: Breaker
    probe: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return f"{self.host}:{self.port}"


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError | asyncio.TimeoutError) and not str(exc):
        return "timed out"
    return f"{type(exc).__name__}: {exc}"


def _hint(reason: str) -> str:
    if "cluster support disabled" in reason:
        return " (this Redis is not a cluster: run it with cluster-enabled yes, docs/l2.md)"
    return ""


class RedisNodes:
    """Which master serves a key, and calls on it that fail fast while it is
    down. Every call raises L2Error (and only that) when it fails."""

    def __init__(
        self,
        seeds: Sequence[tuple[str, int]],
        connect: Connect,
        *,
        timeout_s: float,
        where: str,
        first_backoff_s: float = 0.25,
        most_backoff_s: float = 2.0,
        watch_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._connect = connect
        self._watch_s = watch_s
        self._timeout_s = timeout_s
        self._where = where
        self._first_backoff_s = first_backoff_s
        self._most_backoff_s = most_backoff_s
        self._clock = clock
        self._nodes: dict[str, _Node] = {}
        self._seeds = [self._node(host, port).name for host, port in seeds]
        self._slots: list[str | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
        self._serving: set[str] = set()
        self._mapped = False
        # The slot map's own breaker: loads that all failed, and when to try again.
        self._map = Breaker(first_backoff_s, most_backoff_s, clock)
        self._map_retry_at = 0.0
        self._map_logged = False  # an ERROR said L2 is unusable: say when it is back
        self._loading: asyncio.Task[None] | None = None
        self._refresh_at = 0.0
        self._tasks: set[asyncio.Future[Any]] = set()
        self._closed = False

    # -- state, for the tier's gauges --

    @property
    def up(self) -> bool:
        """The slot map is loaded and every master serving slots answers."""
        return self._mapped and not self.nodes_down

    @property
    def nodes_down(self) -> int:
        return sum(1 for name in self._serving if self._nodes[name].breaker.is_open)

    # -- calls --

    async def watch(self) -> None:
        """Until `close`: load the slot map now (at start); a failure is logged at ERROR
        with its reason, and loads are tried again at a backoff. Then PING
        every master each `watch_s`, so that a master lost while this sidecar
        is idle shows (`up`) before a call pays a timeout for it."""
        with contextlib.suppress(L2Error):
            await self._ensure_map()
        while not self._closed:
            await asyncio.sleep(self._watch_s)
            if not self._mapped:
                with contextlib.suppress(L2Error):
                    await self._ensure_map()
                continue
            watched = [self._nodes[n] for n in self._serving if not self._nodes[n].breaker.is_open]
            await asyncio.gather(
                *(self._on(node, lambda c: c.commands.ping()) for node in watched),
                return_exceptions=True,
            )

    async def call(self, name: str, command: Callable[[Redis], Awaitable[T]]) -> T:
        """`command` on the master serving the key `name`, within the timeout."""
        return await self._route(name, lambda clients: command(clients.commands))

    async def read(self, name: str, command: Callable[[BulkReader], Awaitable[T]]) -> T:
        """`call`, for a command whose reply may be big (BulkReader's)."""
        return await self._route(name, lambda clients: command(clients.reads))

    async def _route(self, name: str, command: Callable[[NodeClients], Awaitable[T]]) -> T:
        await self._ensure_map()
        node = self._serving_node(name)
        try:
            return await self._on(node, command)
        except MovedError as moved:  # resharded: follow it once, and reload the map
            target = self._node(moved.host, moved.port)
            self._slots[moved.slot_id] = target.name
            self._serving.add(target.name)
            self._refresh_soon()
            try:
                return await self._on(target, command)
            except MovedError as again:
                raise L2Error(f"{target.name}: {_describe(again)}") from None

    async def close(self) -> None:
        self._closed = True
        for task in [*self._tasks, *(n.probe for n in self._nodes.values() if n.probe)]:
            task.cancel()
        if self._loading is not None:
            self._loading.cancel()
        for node in self._nodes.values():
            with contextlib.suppress(RedisError, OSError):
                await node.clients.commands.aclose()
            await node.clients.reads.close()

    # -- one node --

    def _node(self, host: str, port: int) -> _Node:
        name = f"{host}:{port}"
        node = self._nodes.get(name)
        if node is None:
            breaker = Breaker(self._first_backoff_s, self._most_backoff_s, self._clock)
            node = self._nodes[name] = _Node(host, port, self._connect(host, port), breaker)
        return node

    def _serving_node(self, name: str) -> _Node:
        slot = key_slot(name.encode())
        node_name = self._slots[slot]
        if node_name is None:
            self._refresh_soon()
            raise L2Error(f"{self._where}: no master serves slot {slot}")
        return self._nodes[node_name]

    async def _on(self, node: _Node, command: Callable[[NodeClients], Awaitable[T]]) -> T:
        """One command on `node`; MovedError passes through, for the caller.

        The command runs in a task of its own, bounded by the timeout, and the
        node is judged by how that task ends: a caller with less time left
        gives up sooner, but a hung node still trips its breaker."""
        if node.breaker.is_open:
            raise L2Error(f"{node.name}: skipped, down since a failure: {node.breaker.reason}")
        task = asyncio.ensure_future(asyncio.wait_for(command(node.clients), self._timeout_s))
        task.add_done_callback(partial(self._judge, node))
        try:
            return await asyncio.shield(task)
        except MovedError:
            raise
        except Exception as exc:  # judged by _judge; the caller goes on without L2
            raise L2Error(f"{node.name}: {_describe(exc)}") from None

    def _judge(self, node: _Node, task: asyncio.Future[Any]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None or isinstance(exc, MovedError):
            return
        if isinstance(exc, ClusterDownError):  # it answers, but the cluster moves: follow it
            self._refresh_soon()
        elif not isinstance(exc, ResponseError):  # not an answer: connection, timeout, …
            self._failed(node, _describe(exc))

    def _failed(self, node: _Node, reason: str) -> None:
        # Its connections may be half-closed (redis-py #4287): none is reused.
        self._spawn(node.clients.commands.connection_pool.disconnect())
        node.clients.reads.drop()
        if not node.breaker.trip(reason) or self._closed:
            return
        if node.name in self._serving:
            _LOGGER.warning(
                "L2 node %s is down (%s): its share of items misses at once until it "
                "answers again (probed at most every %.1fs)",
                node.name,
                reason,
                self._most_backoff_s,
            )
        self._refresh_soon()
        node.probe = asyncio.ensure_future(self._probe(node))

    async def _probe(self, node: _Node) -> None:
        while node.breaker.is_open and not self._closed:
            await asyncio.sleep(node.breaker.backoff_s)
            if self._mapped and node.name not in self._serving:  # failed over: not ours
                node.breaker.reset()
                _LOGGER.info("L2 node %s serves no slots any more: not probed", node.name)
                break
            try:
                await asyncio.wait_for(node.clients.commands.ping(), self._timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                node.breaker.probe_failed(_describe(exc))
                self._refresh_soon()  # a replica may have taken its slots
                continue
            down_s = node.breaker.reset()
            _LOGGER.info("L2 node %s is back after %.1fs", node.name, down_s)
        node.probe = None

    def _spawn(self, work: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Future[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: background failures are logged where they happen

    # -- the slot map --

    async def _ensure_map(self) -> None:
        if self._mapped:
            return
        if self._loading is None:
            if self._clock() < self._map_retry_at:
                raise L2Error(f"{self._where}: not connected: {self._map.reason}")
            self._load_map()
        assert self._loading is not None
        await asyncio.shield(self._loading)

    def _refresh_soon(self) -> None:
        """Reload the map in the background, at most once per first backoff."""
        now = self._clock()
        if self._loading is None and now >= self._refresh_at and not self._closed:
            self._refresh_at = now + self._first_backoff_s
            self._load_map()

    def _load_map(self) -> None:
        task = asyncio.ensure_future(self._load())
        self._loading = task
        task.add_done_callback(self._loaded)

    def _loaded(self, task: asyncio.Task[None]) -> None:
        self._loading = None
        if task.cancelled():
            return
        if task.exception() is None:
            down_s = self._map.reset()
            if self._map_logged:
                self._map_logged = False
                _LOGGER.info(
                    "L2 connected to %s after %.1fs: %d masters",
                    self._where,
                    down_s,
                    len(self._serving),
                )
            return
        reason = str(task.exception())
        if not self._map.trip(reason):
            self._map.probe_failed(reason)
        elif not self._mapped:
            self._map_logged = True
            _LOGGER.error(
                "L2 %s is unusable: %s%s; serving from this sidecar's cache alone, "
                "connecting again every %.1fs at most",
                self._where,
                reason,
                _hint(reason),
                self._most_backoff_s,
            )
        _LOGGER.debug("L2 slot map not loaded: %s", reason)
        self._map_retry_at = self._clock() + self._map.backoff_s

    async def _load(self) -> None:
        """CLUSTER SLOTS from a live node: masters that answer first, then the seeds."""
        known = [n for n in self._serving if not self._nodes[n].breaker.is_open]
        candidates = list(dict.fromkeys([*known, *self._seeds, *self._nodes]))
        reasons = []
        for name in candidates:
            node = self._nodes[name]
            try:
                slots = node.clients.commands.execute_command("CLUSTER", "SLOTS")  # type: ignore[no-untyped-call]
                reply = await asyncio.wait_for(slots, self._timeout_s)
                self._install(node, reply)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                reasons.append(f"{name}: {_describe(exc)}")
        raise L2Error("; ".join(reasons) or "no node to ask")

    def _install(self, asked: _Node, reply: object) -> None:
        """The slot map from a CLUSTER SLOTS reply: [start, end, [host, port, id, …], replicas…]."""
        if not isinstance(reply, list) or not reply:
            raise L2Error("the cluster serves no slots (CLUSTER SLOTS is empty)")
        slots: list[str | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
        for entry in reply:
            try:
                start, end, (host, port, *_rest), *_replicas = entry
                # No host (an "unknown endpoint"): the node that answered.
                host_text = host.decode() if isinstance(host, bytes) else str(host or "")
                node = self._node(host_text if host_text not in ("", "?") else asked.host, port)
                slots[int(start) : int(end) + 1] = [node.name] * (int(end) - int(start) + 1)
            except (TypeError, ValueError) as exc:
                raise L2Error(f"an unexpected CLUSTER SLOTS entry {entry!r}: {exc}") from None
        self._slots = slots
        self._serving = {name for name in slots if name is not None}
        self._mapped = True
        # Nodes gone from the map (replaced pods, failed-over masters) keep no pool.
        for name in [n for n in self._nodes if n not in self._serving and n not in self._seeds]:
            gone = self._nodes.pop(name)
            if gone.probe is not None:
                gone.probe.cancel()
            self._spawn(gone.clients.commands.aclose())
            gone.clients.reads.drop()
