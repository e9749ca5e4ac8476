"""Looking inside a running cache, for people: `mmcache stats`, `mmcache
locate HASH...`, `mmcache get HASH --out DIR`, `mmcache clear`. The client's
wire layer (`mmcache.client.wire`: no torch needed) makes the calls (Info,
Locate, Fetch, Clear), with the token, namespace and TLS settings of any
client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import grpc

from mmcache._errors import InternalError, MMCacheError
from mmcache._frames import chunk_payload_offset
from mmcache.client.wire import CacheTransport, ServerInfo, Spec, Tls, connect, parse_fetched

__all__ = ["Connection", "clear", "get", "locate", "stats"]

_TIERS = {"l1": "held here", "l2": "in L2 only", None: "not held"}


@dataclass(frozen=True)
class Connection:
    """Where and how to call: a target and what a client would send."""

    target: str
    token: str | None = None
    namespace: str = ""
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_server_name: str | None = None
    timeout: float = 5.0

    def tls(self) -> Tls | None:
        if self.tls_ca is None and self.tls_cert is None:
            return None
        return Tls(
            ca=self.tls_ca, cert=self.tls_cert, key=self.tls_key, server_name=self.tls_server_name
        )

    def channel(self) -> grpc.aio.Channel:
        """A channel with the TLS settings alone (no token: `mmcache health`)."""
        return connect(self.target, tls=self.tls())

    @contextlib.asynccontextmanager
    async def calls(self) -> AsyncIterator[CacheTransport]:
        """The server's calls, with the token and namespace, on a channel open
        while the block runs."""
        channel = connect(self.target, tls=self.tls(), token=self.token, namespace=self.namespace)
        async with channel:
            yield CacheTransport(channel, self.timeout)


def _failed(what: str, exc: MMCacheError, out: TextIO) -> int:
    # An internal error's message starts with its status already.
    said = str(exc) if isinstance(exc, InternalError) else f"{exc.code}: {exc}"
    print(f"mmcache {what}: {said}", file=out)
    return 1


def describe(info: ServerInfo, target: str) -> str:
    """The lines `mmcache stats` prints for one Info."""
    ratio = f"{info.hits / info.queries:.1%}" if info.queries else "no queries yet"
    used = info.used_bytes / max(1, info.capacity_bytes)
    l2 = "none" if not info.shared_tier else ("up" if info.l2_up else "DOWN (reads skip it)")
    region = info.region
    shm = "off" if region is None else f"{region.size_bytes / 2**20:.0f} MiB at {region.path}"
    return "\n".join(
        [
            f"mmcache {info.version} at {target} (instance {info.instance_id})",
            f"  items      {info.items} ({info.used_bytes / 2**20:.1f} of "
            f"{info.capacity_bytes / 2**20:.0f} MiB, {used:.0%})",
            f"  hit ratio  {ratio} ({info.hits} hits of {info.queries} queries since start)",
            f"  leases     {info.leases} (items promised to engines, kept until read)",
            f"  namespaces {info.namespaces} in use",
            f"  L2 tier    {l2}",
            f"  shm region {shm}",
        ]
    )


async def stats(
    connection: Connection, watch: float | None = None, out: TextIO = sys.stdout
) -> int:
    """Print the server's state; with `watch`, again every `watch` seconds."""
    try:
        async with connection.calls() as calls:
            while True:
                info = await calls.info(wait_for_ready=False)
                if watch is not None:
                    out.write("\x1b[H\x1b[2J")  # the terminal cleared: a refreshing view
                print(describe(info, connection.target), file=out, flush=True)
                if watch is None:
                    return 0
                await asyncio.sleep(watch)
    except MMCacheError as exc:
        return _failed(f"stats {connection.target}", exc, sys.stderr)


async def locate(
    connection: Connection, hashes: Sequence[str], check_l2: bool, out: TextIO = sys.stdout
) -> int:
    """Print where each hash is held (here, only in L2, nowhere) and its size."""
    try:
        async with connection.calls() as calls:
            where = await calls.locate(list(hashes), check_l2, wait_for_ready=False)
    except MMCacheError as exc:
        return _failed("locate", exc, sys.stderr)
    for mm_hash, tier, size in zip(hashes, where.tiers, where.sizes, strict=True):
        shown = f" ({size} bytes)" if tier == "l1" else ""
        print(f"{mm_hash}  {_TIERS[tier]}{shown}", file=out)
    return 0


async def clear(
    connection: Connection,
    yes: bool,
    ask: Callable[[str], str] = input,
    out: TextIO = sys.stdout,
) -> int:
    """Remove every item of the namespace (leased ones stay until read), after
    asking unless `yes`."""
    where = (
        f"namespace {connection.namespace!r}" if connection.namespace else "the default namespace"
    )
    if not yes:
        try:
            answer = ask(f"remove every item of {where} at {connection.target}? [y/N] ")
        except EOFError:  # no terminal (a script, a pipe): nobody to ask
            print(
                "\nmmcache clear: nobody to ask (standard input is closed): pass --yes "
                "to clear without asking; nothing removed",
                file=sys.stderr,
            )
            return 2
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing removed", file=out)
            return 1
    try:
        async with connection.calls() as calls:
            cleared = await calls.clear(wait_for_ready=False)
    except MMCacheError as exc:
        return _failed("clear", exc, sys.stderr)
    print(
        f"removed {cleared.removed} items of {where}; {cleared.kept_leased} leased ones stay "
        "until their engines read them",
        file=out,
    )
    return 0


def _leaves(spec: Spec) -> list[dict[str, Any]]:
    """Each tensor of an item, where its bytes are in the payload (depth
    first, fields in order: the wire's order)."""
    found: list[dict[str, Any]] = []
    offset = 0
    for leaf in spec.leaves():
        found.append(
            {"path": leaf.path, "dtype": leaf.dtype, "shape": list(leaf.shape), "offset": offset,
             "nbytes": leaf.nbytes}
        )  # fmt: skip
        offset += leaf.nbytes
    return found


def _write(directory: Path, spec: str, payload: bytes) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "spec.json").write_text(spec)
    (directory / "payload.bin").write_bytes(payload)


async def get(connection: Connection, mm_hash: str, out_dir: str, out: TextIO = sys.stdout) -> int:
    """Write an item to `out_dir`: `spec.json` (its fields, and each tensor's
    dtype, shape and place in the payload) and `payload.bin` (the tensors'
    bytes). A read: no query counted, nothing reordered or leased."""
    try:
        async with connection.calls() as calls:
            frames = [frame async for frame in calls.fetch([mm_hash], False, wait=False)]
        (item,) = parse_fetched(frames[0]).items
    except MMCacheError as exc:
        return _failed(f"get {mm_hash}", exc, sys.stderr)
    payload = b"".join(frame[chunk_payload_offset(frame) :] for frame in frames[1:])
    described = item.spec.as_dict()
    described["tensors"] = _leaves(item.spec)
    directory = Path(out_dir)
    _write(directory, json.dumps(described, indent=2) + "\n", payload)
    print(
        f"{mm_hash}: {len(described['tensors'])} tensors, {len(payload)} bytes -> "
        f"{directory}/spec.json, {directory}/payload.bin (e.g. numpy.fromfile with each "
        "tensor's dtype, count and offset)",
        file=out,
    )
    return 0
