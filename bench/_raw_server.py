"""The raw gRPC ceiling: a bare generic handler moving bytes, nothing else.

Upload: a client stream of raw chunks, answered with their total length.
UploadOne: one raw message in a unary call, answered the same way.
UploadProto: the same through protobuf (`UpdateFrame.chunk`), for comparison.
Session: one long-lived bidi stream carrying many uploads: each is a message
naming its chunk count, then the chunks, answered with their total length.
Download: the request names a byte count; the reply streams it as raw
chunks built once beforehand, so no time goes to making data.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator

import grpc

from mmcache._frames import MAX_MESSAGE_BYTES
from mmcache._memory import keep_freed_memory
from mmcache.v1 import cache_pb2 as pb

OPTIONS = (
    ("grpc.so_reuseport", 0),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
)


async def upload(chunks: AsyncIterator[bytes], context: object) -> bytes:
    total = 0
    async for chunk in chunks:
        total += len(chunk)
    return str(total).encode()


async def upload_one(chunk: bytes, context: object) -> bytes:
    return str(len(chunk)).encode()


async def upload_proto(frames: AsyncIterator[pb.UpdateFrame], context: object) -> bytes:
    # The same chunks as protobuf messages: parsed by protobuf, read as a field.
    total = 0
    async for frame in frames:
        total += len(frame.chunk)
    return str(total).encode()


async def session(messages: AsyncIterator[bytes], context: object) -> AsyncIterator[bytes]:
    # No call set-up per upload: what a protocol that reuses streams could reach.
    stream = aiter(messages)
    async for count in stream:
        total = 0
        for _ in range(int(count)):
            total += len(await anext(stream))
        yield str(total).encode()


async def download(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> None:
    nbytes, chunk_bytes = (int(x) for x in request.split(b","))
    chunk = b"\x5a" * chunk_bytes
    for _ in range(nbytes // chunk_bytes):
        await context.write(chunk)


async def main(port: int) -> None:
    server = grpc.aio.server(options=OPTIONS)
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "bench.Raw",
                {
                    "Upload": grpc.stream_unary_rpc_method_handler(upload),
                    "UploadOne": grpc.unary_unary_rpc_method_handler(upload_one),
                    "Download": grpc.unary_stream_rpc_method_handler(download),
                    "Session": grpc.stream_stream_rpc_method_handler(session),
                    "UploadProto": grpc.stream_unary_rpc_method_handler(
                        upload_proto, request_deserializer=pb.UpdateFrame.FromString
                    ),
                },
            ),
        )
    )
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(bound, flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    keep_freed_memory()  # as `mmcache serve` does; the same for both servers
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 0))
