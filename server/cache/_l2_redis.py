"""The L2 tier on Redis Cluster: the commands, as Lua scripts and plain
redis-py calls, routed to masters by server/cache/_redis_nodes.py.

One Redis hash per item, `{prefix}{<tag>}<store key>` (the tag a digest of
the key: a Redis Cluster hash tag): field `m` the manifest,
`c0`, `c1`, … the chunk frames. The braces are a hash tag, so an item's
fields and its claim (`…:f`, single flight, then held) live on one slot of
one master; a sidecar's heartbeat and want list share a tag of its own. And
`allkeys-lru` evicts an item whole. A write is one Lua script (DEL, the
chunks, then the manifest, then the TTL), atomic on its master: a reader
sees a whole item or none, also while another sidecar writes the same hash.

Every call is bounded by the timeout (sockets and an outer wait), makes no
retries of its own, and raises L2Error only. Calls are routed to masters by
server/cache/_redis_nodes.py, which keeps a failure with its node: a dead or hung
master costs one timeout, then its slots miss at once until a probe finds it
answering again.
"""

from __future__ import annotations

import hashlib
import ssl
from urllib.parse import unquote, urlsplit

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from ._l2 import DEFAULT_PREFIX, L2Record, Poll, Sighting, Want
from ._redis_nodes import NodeClients, RedisNodes
from ._resp_reads import BulkReader

__all__ = ["RedisClusterL2", "parse_l2_url", "redis_key"]

_MANIFEST = b"m"

# Scripts run atomically on the slot's master: a reader never sees part of a
# write, in one round trip.
# ARGV: the TTL in ms (0: none), the manifest, then the chunks.
_WRITE = """
redis.call('DEL', KEYS[1])
for i = 3, #ARGV do
    redis.call('HSET', KEYS[1], 'c' .. (i - 3), ARGV[i])
end
redis.call('HSET', KEYS[1], 'm', ARGV[2])
if tonumber(ARGV[1]) > 0 then
    redis.call('PEXPIRE', KEYS[1], ARGV[1])
end
return 1
"""
# A claim: the claimer's node (`o`) and how many others asked (`n`), for the
# window (ARGV[1], ms) from the claim. ARGV[2]: the asking node. Returns a
# Sighting (0 claimed now, 1 the asker's own claim, 2 another node's) and the
# claimer.
_SIGHT = """
local owner = redis.call('HGET', KEYS[1], 'o')
if not owner then
    redis.call('HSET', KEYS[1], 'o', ARGV[2], 'n', 0)
    redis.call('PEXPIRE', KEYS[1], ARGV[1])
    return {0, ARGV[2]}
end
if owner == ARGV[2] then
    return {1, owner}
end
redis.call('HINCRBY', KEYS[1], 'n', 1)
return {2, owner}
"""
# A node holds the item in its cache (ARGV[2]), for ARGV[1] ms at most: its
# claim lasts that long (or is made now). Returns a Sighting and how many
# other nodes asked.
_HOLD = """
local owner = redis.call('HGET', KEYS[1], 'o')
if not owner then
    redis.call('HSET', KEYS[1], 'o', ARGV[2], 'n', 0)
    redis.call('PEXPIRE', KEYS[1], ARGV[1])
    return {0, 0}
end
if owner == ARGV[2] then
    redis.call('PEXPIRE', KEYS[1], ARGV[1])
    return {1, tonumber(redis.call('HGET', KEYS[1], 'n') or '0')}
end
return {2, tonumber(redis.call('HINCRBY', KEYS[1], 'n', 1))}
"""
# KEYS: a node's heartbeat and its want list (one slot). ARGV: the wanted key,
# the list's TTL (ms). 0 when the node is not alive (nobody would read it).
_WANT = """
if redis.call('EXISTS', KEYS[1]) == 0 then
    return 0
end
redis.call('RPUSH', KEYS[2], ARGV[1])
redis.call('LTRIM', KEYS[2], -4096, -1)
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return 1
"""
# KEYS: this node's heartbeat and want list. ARGV: the heartbeat's TTL (ms),
# how many wants to take. Returns the wants taken.
_BEAT = """
redis.call('SET', KEYS[1], '1', 'PX', ARGV[1])
return redis.call('LPOP', KEYS[2], ARGV[2]) or {}
"""
# The claim of a node found dead (ARGV[1]) passes to ARGV[2] for ARGV[3] ms.
_TAKE_OVER = """
if redis.call('HGET', KEYS[1], 'o') == ARGV[1] then
    redis.call('HSET', KEYS[1], 'o', ARGV[2], 'n', 0)
    redis.call('PEXPIRE', KEYS[1], ARGV[3])
    return 1
end
return 0
"""
# ARGV: the node whose claim ends (another node's stays).
_UNCLAIM = """
if redis.call('HGET', KEYS[1], 'o') == ARGV[1] then
    redis.call('DEL', KEYS[1])
end
return 1
"""
# KEYS: the item and its claim (one slot: the same hash tag). Returns a Poll.
_POLL = """
if redis.call('HEXISTS', KEYS[1], 'm') == 1 then
    return 2
end
return redis.call('EXISTS', KEYS[2])
"""


def redis_key(prefix: str, key: str) -> str:
    """The Redis key of the item under the store key `key` (its claim: + ":f").

    The hash tag is a digest of the key, not the key itself: a hash may hold
    braces, which would cut the tag short (an item and its claim on two
    slots) or choose its slot (one tenant's items all on one master)."""
    tag = hashlib.blake2b(key.encode(), digest_size=8).hexdigest()
    return f"{prefix}{{{tag}}}{key}"


def parse_l2_url(url: str) -> tuple[list[tuple[str, int]], str | None, str | None, bool]:
    """`redis://[user:password@]host:port[,host:port…]` (or `rediss://` for TLS):
    the seed nodes, user, password and whether TLS. ValueError says what is wrong."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        raise ValueError("must start redis:// (or rediss:// for TLS)")
    user = password = None
    hosts = parts.netloc
    if "@" in hosts:
        credentials, hosts = hosts.rsplit("@", 1)
        user_part, _, password_part = credentials.partition(":")
        user, password = unquote(user_part) or None, unquote(password_part) or None
    nodes = []
    for hostport in hosts.split(","):
        host, sep, port = hostport.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{hostport!r} is not host:port (give each seed node as host:port)")
        nodes.append((host.strip("[]"), int(port)))
    return nodes, user, password, parts.scheme == "rediss"


class RedisClusterL2:
    """An `L2Backend` on a Redis Cluster, routed by `RedisNodes`: it connects at
    start (`connect`) and on first use, and again after a failure, so a sidecar
    starts while its cluster is down and heals when it comes back."""

    def __init__(
        self,
        url: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        timeout_s: float,
        max_connections: int = 64,
    ) -> None:
        seeds, user, password, tls = parse_l2_url(url)
        self._prefix = prefix
        self._where = f"redis cluster {','.join(f'{h}:{p}' for h, p in seeds)}"

        # As redis-py's ssl=True: the system's CAs, the host name checked.
        context = ssl.create_default_context() if tls else None

        def connect(host: str, port: int) -> NodeClients:
            commands = Redis(
                host=host,
                port=port,
                username=user,
                password=password,
                ssl=tls,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
                # The caller falls back to L1 at once: a retry would only spend its time.
                retry=Retry(NoBackoff(), 0),
                # Above the tier's own bound on operations at once (L2Settings).
                max_connections=max_connections,
                decode_responses=False,
            )
            reads = BulkReader(
                host,
                port,
                username=user,
                password=password,
                tls=context,
                connect_timeout_s=timeout_s,
            )
            return NodeClients(commands, reads)

        self._nodes = RedisNodes(seeds, connect, timeout_s=timeout_s, where=self._where)

    @property
    def where(self) -> str:
        return self._where

    @property
    def up(self) -> bool:
        return self._nodes.up

    @property
    def nodes_down(self) -> int:
        return self._nodes.nodes_down

    async def watch(self) -> None:
        await self._nodes.watch()

    def _key(self, key: str) -> str:
        return redis_key(self._prefix, key)

    async def read(self, key: str) -> L2Record | None:
        name = self._key(key)
        # By BulkReader: each chunk received straight into its bytes' buffer.
        raw = await self._nodes.read(name, lambda r: r.command(b"HGETALL", name))
        if not isinstance(raw, list) or len(raw) % 2:
            return None  # not a hash's reply (another type under the key): a miss
        pairs = zip(raw[::2], raw[1::2], strict=True)
        fields = {k: v for k, v in pairs if isinstance(k, bytes) and isinstance(v, bytes)}
        manifest = fields.pop(_MANIFEST, None)
        if manifest is None:
            return None
        chunks = [fields.get(b"c%d" % n) for n in range(len(fields))]
        if any(c is None for c in chunks):
            return L2Record(manifest, ())  # fields of another shape: the check refuses it
        return L2Record(manifest, tuple(c for c in chunks if c is not None))

    async def holds(self, key: str) -> bool:
        name = self._key(key)
        found = await self._nodes.call(name, lambda r: r.hexists(name, _MANIFEST))
        return bool(found)

    async def write(self, key: str, record: L2Record, ttl_s: float) -> None:
        name, ttl_ms = self._key(key), int(ttl_s * 1000)
        await self._nodes.call(
            name, lambda r: r.eval(_WRITE, 1, name, ttl_ms, record.manifest, *record.chunks)
        )

    async def sight(self, key: str, window_s: float, node: str) -> tuple[Sighting, str]:
        name, window_ms = self._key(key) + ":f", max(1, int(window_s * 1000))
        found, owner = await self._nodes.call(
            name, lambda r: r.eval(_SIGHT, 1, name, window_ms, node)
        )
        return Sighting(int(found)), owner.decode() if isinstance(owner, bytes) else str(owner)

    async def hold(self, key: str, node: str, hold_s: float) -> tuple[Sighting, int]:
        name, hold_ms = self._key(key) + ":f", max(1, int(hold_s * 1000))
        found, asked = await self._nodes.call(name, lambda r: r.eval(_HOLD, 1, name, hold_ms, node))
        return Sighting(int(found)), int(asked)

    async def want(self, owner: str, key: str) -> Want:
        alive, wants = self._node_keys(owner)
        ttl_ms = 60_000  # a node that stopped reading its list leaves no garbage
        found = await self._nodes.call(alive, lambda r: r.eval(_WANT, 2, alive, wants, key, ttl_ms))
        return Want.ASKED if int(found) else Want.OWNER_GONE

    async def take_over(self, key: str, dead: str, node: str, window_s: float) -> bool:
        name, window_ms = self._key(key) + ":f", max(1, int(window_s * 1000))
        found = await self._nodes.call(
            name, lambda r: r.eval(_TAKE_OVER, 1, name, dead, node, window_ms)
        )
        return bool(int(found))

    async def beat(self, node: str, alive_s: float, most: int) -> list[str]:
        alive, wants = self._node_keys(node)
        alive_ms = max(1, int(alive_s * 1000))
        taken = await self._nodes.call(
            alive, lambda r: r.eval(_BEAT, 2, alive, wants, alive_ms, most)
        )
        return [k.decode() for k in taken if isinstance(k, bytes)]

    async def leave(self, node: str) -> None:
        alive, wants = self._node_keys(node)
        await self._nodes.call(alive, lambda r: r.delete(alive, wants))

    def _node_keys(self, node: str) -> tuple[str, str]:
        """A node's heartbeat and want list: one slot (a hash tag of its digest)."""
        tag = hashlib.blake2b(node.encode(), digest_size=8).hexdigest()
        base = f"{self._prefix}node:{{{tag}}}"
        return base + ":alive", base + ":wants"

    async def unclaim(self, key: str, node: str) -> None:
        name = self._key(key) + ":f"
        await self._nodes.call(name, lambda r: r.eval(_UNCLAIM, 1, name, node))

    async def poll(self, key: str) -> Poll:
        name = self._key(key)
        found = await self._nodes.call(name, lambda r: r.eval(_POLL, 2, name, name + ":f"))
        return Poll(int(found))

    async def close(self) -> None:
        await self._nodes.close()
