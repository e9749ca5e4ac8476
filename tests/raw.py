"""Hand-built requests for the server tests: real gRPC, no mmcache client.

They let the tests send what a buggy or hostile client could send.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from mmcache._frames import UPDATE_HEADER_KEY, chunk_prefix
from mmcache.v1 import cache_pb2 as pb

SERVICE = "/mmcache.v1.MMCache"


def tensor_spec(dtype: str, shape: Sequence[int], key: str = "pixel_values") -> pb.ItemSpec:
    spec = pb.ItemSpec(form=pb.ItemSpec.FORM_MAPPING)
    spec.fields.add(key=key).data.tensor.CopyFrom(pb.TensorSpec(dtype=dtype, shape=shape))
    return spec


def chunk(data: bytes) -> bytes:
    return chunk_prefix(len(data)) + data


def header(*entries: pb.UpdateEntry, touches: Sequence[str] = ()) -> bytes:
    return pb.UpdateFrame(
        header=pb.UpdateRequest(entries=entries, touches=touches)
    ).SerializeToString()


def data_entry(mm_hash: str, spec: pb.ItemSpec, num_chunks: int, **kw: object) -> pb.UpdateEntry:
    return pb.UpdateEntry(mm_hash=mm_hash, item=spec, num_chunks=num_chunks, **kw)  # type: ignore[arg-type]


async def update(
    channel: grpc.aio.Channel, frames: Sequence[bytes], metadata_header: bytes | None = None
) -> pb.UpdateReply:
    """A GetAndUpdate of raw frames; with `metadata_header`, the header goes as metadata."""
    call = channel.stream_unary(f"{SERVICE}/GetAndUpdate")
    metadata = None if metadata_header is None else ((UPDATE_HEADER_KEY, metadata_header),)

    async def gen():  # type: ignore[no-untyped-def]
        for frame in frames:
            yield frame

    return pb.UpdateReply.FromString(await call(gen(), timeout=30, metadata=metadata))


async def update_one(
    channel: grpc.aio.Channel, request: bytes, metadata_header: bytes | None = None
) -> pb.UpdateReply:
    """A GetAndUpdateOne: the unary form, its request one frame or empty."""
    call = channel.unary_unary(f"{SERVICE}/GetAndUpdateOne")
    metadata = None if metadata_header is None else ((UPDATE_HEADER_KEY, metadata_header),)
    return pb.UpdateReply.FromString(await call(request, timeout=30, metadata=metadata))


async def fetch(channel: grpc.aio.Channel, hashes: Sequence[str]) -> list[bytes]:
    call = channel.unary_stream(f"{SERVICE}/Fetch")
    return [frame async for frame in call(pb.FetchRequest(mm_hashes=hashes).SerializeToString())]
