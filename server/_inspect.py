"""Looking inside a running cache, for people: `mmcache stats`, `mmcache
locate HASH...`, `mmcache get HASH --out DIR`, `mmcache clear`. Plain gRPC
calls (Info, Locate, Fetch, Clear) with the token, namespace and TLS settings
of any client; no torch needed."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import grpc
from google.protobuf import json_format

from mmcache._dtypes import nbytes_of
from mmcache._spec import NAMESPACE_KEY
from mmcache.v1 import cache_pb2 as pb

from ._auth import AUTHORIZATION_KEY

__all__ = ["Connection", "clear", "get", "locate", "stats"]

_SERVICE = "/mmcache.v1.MMCache"
_TIERS = {pb.TIER_L1: "held here", pb.TIER_L2: "in L2 only", pb.TIER_NONE: "not held"}


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

    def channel(self) -> grpc.aio.Channel:
        if self.tls_ca is None and self.tls_cert is None:
            return grpc.aio.insecure_channel(self.target)
        credentials = grpc.ssl_channel_credentials(
            root_certificates=None if self.tls_ca is None else _read(self.tls_ca),
            private_key=None if self.tls_key is None else _read(self.tls_key),
            certificate_chain=None if self.tls_cert is None else _read(self.tls_cert),
        )
        options = (
            []
            if self.tls_server_name is None
            else [("grpc.ssl_target_name_override", self.tls_server_name)]
        )
        return grpc.aio.secure_channel(self.target, credentials, options=options)

    def metadata(self) -> list[tuple[str, str]]:
        sent = []
        if self.token:
            sent.append((AUTHORIZATION_KEY, f"Bearer {self.token}"))
        if self.namespace:
            sent.append((NAMESPACE_KEY, self.namespace))
        return sent

    async def call(self, method: str, request: Any, reply: Callable[[bytes], Any]) -> Any:
        async with self.channel() as channel:
            stub = channel.unary_unary(
                f"{_SERVICE}/{method}",
                request_serializer=type(request).SerializeToString,
                response_deserializer=reply,
            )
            return await stub(request, timeout=self.timeout, metadata=self.metadata())


def _read(path: str) -> bytes:
    with open(path, "rb") as file:
        return file.read()


def _failed(what: str, exc: grpc.aio.AioRpcError, out: TextIO) -> int:
    print(f"mmcache {what}: {exc.code().name}: {exc.details()}", file=out)
    return 1


def describe(info: pb.InfoReply, target: str) -> str:
    """The lines `mmcache stats` prints for one Info."""
    ratio = f"{info.hits / info.queries:.1%}" if info.queries else "no queries yet"
    used = info.used_bytes / max(1, info.capacity_bytes)
    l2 = "none" if not info.shared_tier else ("up" if info.l2_up else "DOWN (reads skip it)")
    shm = (
        f"{info.shm.size_bytes / 2**20:.0f} MiB at {info.shm.path}"
        if info.HasField("shm")
        else "off"
    )
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
    while True:
        try:
            info = await connection.call("Info", pb.InfoRequest(), pb.InfoReply.FromString)
        except grpc.aio.AioRpcError as exc:
            return _failed(f"stats {connection.target}", exc, sys.stderr)
        if watch is not None:
            out.write("\x1b[H\x1b[2J")  # the terminal cleared: a refreshing view
        print(describe(info, connection.target), file=out, flush=True)
        if watch is None:
            return 0
        await asyncio.sleep(watch)


async def locate(
    connection: Connection, hashes: Sequence[str], check_l2: bool, out: TextIO = sys.stdout
) -> int:
    """Print where each hash is held (here, only in L2, nowhere) and its size."""
    request = pb.LocateRequest(mm_hashes=list(hashes), check_l2=check_l2)
    try:
        reply = await connection.call("Locate", request, pb.LocateReply.FromString)
    except grpc.aio.AioRpcError as exc:
        return _failed("locate", exc, sys.stderr)
    for mm_hash, tier, size in zip(hashes, reply.tiers, reply.sizes, strict=True):
        shown = f" ({size} bytes)" if tier == pb.TIER_L1 else ""
        print(f"{mm_hash}  {_TIERS.get(tier, 'unknown')}{shown}", file=out)
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
        reply = await connection.call("Clear", pb.ClearRequest(), pb.ClearReply.FromString)
    except grpc.aio.AioRpcError as exc:
        return _failed("clear", exc, sys.stderr)
    print(
        f"removed {reply.removed} items of {where}; {reply.kept_leased} leased ones stay "
        "until their engines read them",
        file=out,
    )
    return 0


def _leaves(spec: pb.ItemSpec) -> list[dict[str, Any]]:
    """Each tensor of an item, where its bytes are in the payload (depth
    first, fields in order: the wire's order)."""
    found: list[dict[str, Any]] = []
    offset = 0

    def walk(node: pb.Node, path: str) -> None:
        nonlocal offset
        kind = node.WhichOneof("kind")
        if kind == "tensor":
            nbytes = nbytes_of(node.tensor.dtype, node.tensor.shape)
            shape = list(node.tensor.shape)
            found.append(
                {"path": path, "dtype": node.tensor.dtype, "shape": shape, "offset": offset,
                 "nbytes": nbytes}
            )  # fmt: skip
            offset += nbytes
        elif kind in ("list", "tuple"):
            for i, child in enumerate(getattr(node, kind).items):
                walk(child, f"{path}[{i}]")

    for field in spec.fields:
        walk(field.data, field.key)
    return found


def _write(directory: Path, spec: str, payload: bytes) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "spec.json").write_text(spec)
    (directory / "payload.bin").write_bytes(payload)


async def get(connection: Connection, mm_hash: str, out_dir: str, out: TextIO = sys.stdout) -> int:
    """Write an item to `out_dir`: `spec.json` (its fields, and each tensor's
    dtype, shape and place in the payload) and `payload.bin` (the tensors'
    bytes). A read: no query counted, nothing reordered or leased."""
    request = pb.FetchRequest(mm_hashes=[mm_hash])
    try:
        async with connection.channel() as channel:
            stub = channel.unary_stream(
                f"{_SERVICE}/Fetch",
                request_serializer=pb.FetchRequest.SerializeToString,
                response_deserializer=pb.FetchFrame.FromString,
            )
            frames = [
                frame
                async for frame in stub(
                    request, timeout=connection.timeout, metadata=connection.metadata()
                )
            ]
    except grpc.aio.AioRpcError as exc:
        return _failed(f"get {mm_hash}", exc, sys.stderr)
    (item,) = frames[0].header.items
    payload = b"".join(frame.chunk for frame in frames[1:])
    described = json_format.MessageToDict(item.item)
    described["tensors"] = _leaves(item.item)
    directory = Path(out_dir)
    _write(directory, json.dumps(described, indent=2) + "\n", payload)
    print(
        f"{mm_hash}: {len(described['tensors'])} tensors, {len(payload)} bytes -> "
        f"{directory}/spec.json, {directory}/payload.bin (e.g. numpy.fromfile with each "
        "tensor's dtype, count and offset)",
        file=out,
    )
    return 0
