"""The frames of the bulk calls, written and read without protobuf.

A chunk frame is the protobuf encoding of a frame message that holds only
`bytes chunk = 2`: the tag byte 0x12, the payload length as a varint, then
the payload. Writing that prefix by hand costs one copy of the payload where
protobuf's `bytes` field costs one per construction, serialisation and parse,
and lets the server keep the frames it received and send them back verbatim.

An upload's header travels in the call's metadata when it is small (a
message fewer per call), else as a header frame (`header = 1`) before the
chunks; a Fetch reply's header is always a header frame.
"""

from __future__ import annotations

from ._errors import InvalidArgumentError

__all__ = [
    "CHUNK_TAG",
    "DEFAULT_CHUNK_BYTES",
    "HEADER_TAG",
    "KEEPALIVE_MS",
    "MAX_CHUNK_BYTES",
    "MAX_MESSAGE_BYTES",
    "MAX_METADATA_HEADER_BYTES",
    "MIN_CHUNK_BYTES",
    "UPDATE_HEADER_KEY",
    "chunk_payload_offset",
    "chunk_prefix",
    "header_frame",
    "header_frame_body",
    "read_varint",
]

HEADER_TAG = 0x0A  # field 1, length-delimited: a frame's header
CHUNK_TAG = 0x12  # field 2, length-delimited: a frame's chunk

MIN_CHUNK_BYTES = 1 << 20
DEFAULT_CHUNK_BYTES = 1 << 20
MAX_CHUNK_BYTES = 4 << 20
# Large enough for a full chunk frame and for a batch header, and far below
# any item's size: items of any size move as many messages.
MAX_MESSAGE_BYTES = 8 << 20

# Clients ping an idle connection this often; servers accept pings this often.
KEEPALIVE_MS = 20_000

# Binary metadata of a GetAndUpdate call that carries its serialised
# `UpdateRequest` in place of a header frame. (Fetch keeps its header frame:
# initial metadata sent apart from the first message cost more than it saved.)
UPDATE_HEADER_KEY = "mmcache-update-header-bin"
# Headers above this go as a frame: grpc's default metadata limit is 8 KiB
# per call (base64 on the wire), and callers' own metadata needs room too.
MAX_METADATA_HEADER_BYTES = 2048


def _prefix(tag: int, n: int) -> bytes:
    out = bytearray((tag,))
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def chunk_prefix(n: int) -> bytes:
    """The tag and varint length that precede a chunk of `n` bytes."""
    return _prefix(CHUNK_TAG, n)


def header_frame(header: bytes) -> bytes:
    """A frame holding only `header = 1`, from the header's serialised bytes."""
    return _prefix(HEADER_TAG, len(header)) + header


def read_varint(frame: bytes, pos: int, what: str = "frame") -> tuple[int, int]:
    """The varint at `pos`: (where the bytes after it start, its value).

    Raises InvalidArgumentError, naming `what`, when it runs past the frame
    or past 5 bytes (protobuf's limit for a length, which its parsers hold
    every reader of a stored frame to).
    """
    n = 0
    shift = 0
    end = min(len(frame), pos + 5)
    while pos < end:
        byte = frame[pos]
        n |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return pos, n
        shift += 7
    raise InvalidArgumentError(f"{what} has a truncated length")


def chunk_payload_offset(frame: bytes) -> int:
    """Where the payload of a chunk frame starts, checking the frame is one.

    Raises InvalidArgumentError when the frame is not a single chunk member
    whose declared length is exactly the rest of the frame.
    """
    if not frame or frame[0] != CHUNK_TAG:
        raise InvalidArgumentError(
            "expected a chunk frame (field 2); got "
            + ("an empty frame" if not frame else f"a frame starting with tag byte {frame[0]:#04x}")
        )
    pos, n = read_varint(frame, 1, "chunk frame")
    if n != len(frame) - pos:
        raise InvalidArgumentError(f"chunk frame declares {n} bytes but carries {len(frame) - pos}")
    return pos


def header_frame_body(frame: bytes, what: str) -> bytes:
    """The serialised header inside a header frame, checking the frame is one.

    Raises InvalidArgumentError, naming `what`, when the frame is anything
    but the header field alone.
    """
    if not frame or frame[0] != HEADER_TAG:
        raise InvalidArgumentError(
            f"{what} must be the header (field 1) alone; got "
            + ("an empty frame" if not frame else f"a frame starting with tag byte {frame[0]:#04x}")
        )
    pos, n = read_varint(frame, 1, what)
    if n != len(frame) - pos:
        raise InvalidArgumentError(
            f"{what} declares a header of {n} bytes but carries {len(frame) - pos} after its "
            "tag: it must hold the header alone, with chunks in frames of their own"
        )
    return frame[pos:]
