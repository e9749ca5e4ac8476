"""Property-based tests (hypothesis) of the wire: the codec and the parsers.

Two kinds of property. Round trips: any item the codec accepts comes back
bit for bit, whether straight from its frames or through the server's upload
parsers and a Fetch reply, and any spec the decoder accepts encodes back to
itself. Robustness: arbitrary bytes, arbitrary protobuf requests and random
mutations of valid uploads make the parsers raise mmcache's own errors and
nothing else, and whatever they accept is consistent.

The bugs the properties found are pinned by the tests at the end.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import AsyncIterator, Coroutine, Iterable, Sequence
from typing import Any, TypeVar, cast

import pytest
import torch
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from mmcache import BatchedField, FieldElem, FlatField, MMItem, SharedField
from mmcache._dtypes import ITEMSIZE
from mmcache._equal import nested_equal
from mmcache._errors import InvalidArgumentError, MMCacheError
from mmcache._frames import (
    CHUNK_TAG,
    HEADER_TAG,
    MAX_CHUNK_BYTES,
    UPDATE_HEADER_KEY,
    chunk_payload_offset,
    chunk_prefix,
    header_frame,
    header_frame_body,
    read_varint,
)
from mmcache._items import Field, Item
from mmcache._spec import MAX_DEPTH, MAX_NAME_CHARS, check_name, item_size
from mmcache.client._codec import (
    ItemDecoder,
    decode_item,
    encode_item,
    iter_chunk_frames,
    num_chunks,
)
from mmcache.client._fetched import read_fetch
from mmcache.client.wire import Spec
from mmcache.server._upload import (
    Context,
    check_no_surplus,
    parse_header,
    read_chunks,
    read_request,
)
from mmcache.server.cache import EntryHeader, upload_entry
from mmcache.server.cache._store import UploadEntry
from mmcache.v1 import cache_pb2 as pb

# Few examples, no deadline (the first tensors warm torch up), and no example
# database: the whole module stays within seconds and writes nothing.
SETTINGS = settings(
    max_examples=100,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
CHEAP = settings(SETTINGS, max_examples=200)

T = TypeVar("T")

DTYPES = sorted(ITEMSIZE)
INT64 = st.integers(-(1 << 63), (1 << 63) - 1)
# Names a caller may use: 1 to 8 characters, never NUL (the server's separator).
NAME_CHARS = st.characters(codec="utf-8", exclude_characters="\x00")
NAMES = st.text(NAME_CHARS, min_size=1, max_size=8)


# -- running the server's async parsers on in-memory frames ---------------------


def drive(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine that never waits (its frames are in memory) to its end."""
    try:
        coro.send(None)
    except StopIteration as done:
        return cast(T, done.value)
    coro.close()
    raise AssertionError("the coroutine waited for something")


async def in_memory(frames: Iterable[bytes]) -> AsyncIterator[bytes]:
    for frame in frames:
        yield frame


class CallMetadata:
    """The one part of a grpc ServicerContext that `read_request` reads."""

    def __init__(self, header: bytes | None) -> None:
        self._pairs = () if header is None else ((UPDATE_HEADER_KEY, header),)

    def invocation_metadata(self) -> tuple[tuple[str, bytes], ...]:
        return self._pairs


Received = tuple[pb.UpdateRequest, list[EntryHeader], list[UploadEntry]]


def server_reads(frames: Sequence[bytes], metadata_header: bytes | None = None) -> Received:
    """What the servicer's GetAndUpdate reads from a call, in its order, up to the store."""

    async def run() -> Received:
        stream = in_memory(frames)
        context = cast(Context, CallMetadata(metadata_header))
        request, in_metadata = await read_request(context, stream)
        entries = parse_header(request)
        uploads = [
            upload_entry(e, () if e.chunks is None else await read_chunks(stream, e))
            for e in entries
        ]
        await check_no_surplus(stream, in_metadata)
        return request, entries, uploads

    return drive(run())


def payload_of(frames: Iterable[bytes]) -> bytes:
    return b"".join(frame[chunk_payload_offset(frame) :] for frame in frames)


# -- strategies: items the codec accepts ------------------------------------------


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    """Any dtype, shapes from 0-d to 3-d (empty ones too), any bits, any layout."""
    dtype = getattr(torch, draw(st.sampled_from(DTYPES)))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    nbytes = math.prod(shape) * ITEMSIZE[str(dtype).removeprefix("torch.")]
    raw = torch.tensor(list(draw(st.binary(min_size=nbytes, max_size=nbytes))), dtype=torch.uint8)
    if dtype == torch.bool:
        raw = raw % 2  # a bool's byte is 0 or 1
    tensor = raw.view(dtype).reshape(shape)
    layout = draw(st.sampled_from(["contiguous", "transposed", "strided", "conj"]))
    if layout == "transposed" and tensor.dim() >= 2:
        tensor = tensor.transpose(0, -1)
    elif layout == "strided" and tensor.dim() >= 1:
        tensor = tensor[::2]
    elif layout == "conj" and dtype in (torch.complex64, torch.complex128):
        tensor = tensor.conj()  # a lazy view: the codec sends its values
    return tensor


SCALARS = st.one_of(INT64, st.floats(), st.booleans())  # floats: NaNs, infinities, -0.0
DATA: st.SearchStrategy[Any] = st.recursive(
    tensors() | SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.lists(inner, max_size=3).map(tuple),
    max_leaves=5,
)
OPT_INT64 = st.none() | INT64
SLICES = st.builds(slice, OPT_INT64, OPT_INT64, OPT_INT64)
FIELDS: st.SearchStrategy[Field] = st.one_of(
    st.builds(BatchedField, keep_on_cpu=st.booleans()),
    st.builds(SharedField, batch_size=INT64, keep_on_cpu=st.booleans()),
    st.builds(
        FlatField,
        slices=st.lists(SLICES | st.lists(SLICES, max_size=3).map(tuple), max_size=3),
        dim=INT64,
        keep_on_cpu=st.booleans(),
    ),
)


@st.composite
def items(draw: st.DrawFn) -> Item:
    """An MMItem (field kinds and modalities kept) or a plain mapping, empty ones too."""
    keys = draw(st.lists(NAMES, max_size=4, unique=True))
    if draw(st.booleans()):
        modality = st.sampled_from(["", "image", "video"]) | NAMES
        return MMItem.from_elems(
            [FieldElem(draw(modality), key, draw(DATA), draw(FIELDS)) for key in keys]
        )
    return {key: draw(DATA) for key in keys}


CHUNK_BYTES = st.integers(1, 48) | st.just(MAX_CHUNK_BYTES)


def leaves(data: object) -> Iterable[torch.Tensor]:
    if isinstance(data, torch.Tensor):
        yield data
    elif isinstance(data, list | tuple):
        for child in data:
            yield from leaves(child)


def assert_same_item(out: Item, item: Item) -> None:
    """The form, the keys in order, and bit-identical data (and fields, for an MMItem)."""
    assert type(out) is (MMItem if isinstance(item, MMItem) else dict)
    assert list(out) == list(item)
    if isinstance(item, MMItem):
        assert out == item  # FieldElem equality: key, modality, field and bits
    else:
        for key, value in item.items():
            assert nested_equal(out[key], value), key
    for got in out.values():
        for tensor in leaves(got.data if isinstance(got, FieldElem) else got):
            assert tensor.is_contiguous()
            assert tensor.untyped_storage().nbytes() == tensor.nbytes  # storage of its own


# -- round trips ------------------------------------------------------------------


@SETTINGS
@given(item=items(), chunk_bytes=CHUNK_BYTES)
def test_any_item_round_trips_bit_exact_through_its_spec_and_frames(
    item: Item, chunk_bytes: int
) -> None:
    encoded = encode_item(item)
    frames = list(iter_chunk_frames(encoded, chunk_bytes))
    assert len(frames) == num_chunks(encoded, chunk_bytes)
    sizes = [len(frame) - chunk_payload_offset(frame) for frame in frames]
    assert all(0 < n <= chunk_bytes for n in sizes)
    assert all(n == chunk_bytes for n in sizes[:-1])  # only the last is short
    assert sum(sizes) == encoded.size.payload == sum(t.nbytes for t in encoded.tensors)
    assert encoded.size == item_size(encoded.spec.message)
    # The spec as it travels: serialised and parsed again.
    spec = Spec(pb.ItemSpec.FromString(encoded.spec.serialize()))
    assert_same_item(decode_item(spec, frames), item)


@SETTINGS
@given(
    batch=st.lists(st.tuples(items(), st.binary(max_size=8)), max_size=3),
    hash_only=st.lists(NAMES.map("known-".__add__), max_size=2),
    chunk_bytes=st.integers(1, 48),
    in_metadata=st.booleans(),
)
def test_uploads_pass_the_server_parsers_and_come_back_bit_exact_in_a_fetch(
    batch: list[tuple[Item, bytes]], hash_only: list[str], chunk_bytes: int, in_metadata: bool
) -> None:
    request = pb.UpdateRequest(touches=hash_only)
    chunks: list[bytes] = []
    for n, (item, metadata) in enumerate(batch):
        encoded = encode_item(item, modality="image")
        frames = list(iter_chunk_frames(encoded, chunk_bytes))
        request.entries.add(
            mm_hash=f"h{n}",
            modality=encoded.modality,
            item=encoded.spec.message,
            num_chunks=len(frames),
            metadata=metadata,
        )
        chunks += frames
    for mm_hash in hash_only:
        request.entries.add(mm_hash=mm_hash, want_metadata=True)
    header = request.SerializeToString()
    if in_metadata:
        received = server_reads(chunks, header)
    else:
        received = server_reads([header_frame(header), *chunks])
    parsed, entries, uploads = received
    assert parsed == request
    assert [u.mm_hash for u in uploads] == [e.mm_hash for e in request.entries]
    stored = [u.item for u in uploads if u.item is not None]
    assert len(stored) == len(batch)
    assert [f for s in stored for f in s.frames] == chunks  # kept as received
    for entry, upload, (_, metadata) in zip(entries[: len(batch)], stored, batch, strict=True):
        size = item_size(pb.ItemSpec.FromString(upload.spec))
        assert (upload.payload, upload.size) == (size.payload, size.charged + len(metadata))
        assert upload.metadata == metadata and entry.charged == upload.size
    assert all(not u.withheld and u.want_metadata for u in uploads[len(batch) :])

    # The Fetch reply: the stored specs and the very same frames, read by the client.
    fetched = pb.FetchHeader(instance_id="i")
    for n, upload in enumerate(stored):
        fetched.items.add(mm_hash=f"h{n}", num_chunks=len(upload.frames)).item.MergeFromString(
            upload.spec
        )
    reply = [header_frame(fetched.SerializeToString())]
    reply += [f for upload in stored for f in upload.frames]
    transported = [header_frame_body(reply[0], "the first Fetch frame"), *reply[1:]]
    out = drive(read_fetch(in_memory(transported), len(stored)))
    for got, (item, _) in zip(out, batch, strict=True):
        assert_same_item(got, item)


# -- robustness: protobuf requests of any content ---------------------------------


# Each strategy comes in two kinds: `valid`, every choice one the parsers
# accept (so the properties reach past the first check), and not, any value of
# each field. The tests draw from both.


def nodes(dims: st.SearchStrategy[int], valid: bool) -> st.SearchStrategy[pb.Node]:
    """Data nodes of any shape; not `valid`: unknown dtypes, nodes with no value."""
    dtypes = st.sampled_from(DTYPES)
    tensor = st.builds(
        lambda dtype, shape: pb.Node(tensor=pb.TensorSpec(dtype=dtype, shape=shape)),
        dtypes if valid else dtypes | st.text(max_size=6),
        st.lists(dims, max_size=3),
    )
    leaf = st.one_of(
        tensor,
        INT64.map(lambda v: pb.Node(int_value=v)),
        st.floats().map(lambda v: pb.Node(float_value=v)),
        st.booleans().map(lambda v: pb.Node(bool_value=v)),
    )
    if not valid:
        leaf |= st.just(pb.Node())  # no value

    def nest(children: st.SearchStrategy[pb.Node]) -> st.SearchStrategy[pb.Node]:
        lists = st.lists(children, max_size=3)
        return st.one_of(
            lists.map(lambda xs: pb.Node(list=pb.NodeList(items=xs))),
            lists.map(lambda xs: pb.Node(tuple=pb.NodeList(items=xs))),
        )

    def deep(node: pb.Node, depth: int) -> pb.Node:
        for _ in range(depth):
            node = pb.Node(list=pb.NodeList(items=[node]))
        return node

    # Nested exactly as deep as allowed (or, not valid, one level deeper).
    at_the_limit = st.builds(deep, leaf, st.just(MAX_DEPTH + (not valid)))
    return st.recursive(leaf, nest, max_leaves=6) | at_the_limit


BAD_NAMES = st.just("") | st.just("k" * (MAX_NAME_CHARS + 1)) | st.text(max_size=3)
PB_SLICES = st.builds(pb.Slice, start=OPT_INT64, stop=OPT_INT64, step=OPT_INT64)
PB_SLICE_ENTRIES = st.one_of(
    PB_SLICES.map(lambda s: pb.SliceEntry(slice=s)),
    st.lists(PB_SLICES, max_size=2).map(lambda xs: pb.SliceEntry(tuple=pb.SliceTuple(slices=xs))),
    st.just(pb.SliceEntry()),  # neither: the server does not look, the client reads ()
)


@st.composite
def field_elems(
    draw: st.DrawFn, key: str, form: int, dims: st.SearchStrategy[int], valid: bool
) -> pb.FieldElem:
    modalities = NAMES | st.just("")
    elem = pb.FieldElem(
        key=key,
        modality=draw(modalities if valid else modalities | BAD_NAMES),
        data=draw(nodes(dims, valid)),
        keep_on_cpu=draw(st.booleans()),
    )
    kinds: list[str | None] = ["batched", "flat", "shared"]
    if not valid or form != pb.ItemSpec.FORM_ITEM:
        kinds.append(None)  # no field kind: fine for a mapping only
    kind = draw(st.sampled_from(kinds))
    if kind == "batched":
        elem.batched.SetInParent()
    elif kind == "flat":
        elem.flat.dim = draw(INT64)
        elem.flat.slices.extend(draw(st.lists(PB_SLICE_ENTRIES, max_size=2)))
    elif kind == "shared":
        elem.shared.batch_size = draw(INT64)
    return elem


@st.composite
def specs(draw: st.DrawFn, dims: st.SearchStrategy[int], valid: bool) -> pb.ItemSpec:
    forms = st.sampled_from([pb.ItemSpec.FORM_ITEM, pb.ItemSpec.FORM_MAPPING])
    form = draw(forms if valid else forms | st.integers(-3, 5))  # an open enum: any value parses
    if valid:
        keys = draw(st.lists(NAMES, max_size=3, unique=True))
    else:
        keys = draw(st.lists(NAMES | BAD_NAMES, max_size=3))  # duplicates too
    fields = [draw(field_elems(key, form, dims, valid)) for key in keys]
    return pb.ItemSpec(form=cast("pb.ItemSpec.Form.ValueType", form), fields=fields)


# Valid: tiny dimensions. Invalid too: ones so large that a tensor spans more
# than 2**48 bytes, even beside a zero dimension (its strides would overflow).
HUGE = st.sampled_from([1 << 24, 1 << 40, 1 << 62, (1 << 63) - 1])
VALID_DIMS = st.integers(0, 4)
ANY_DIMS = VALID_DIMS | HUGE | st.integers(-2, -1) | st.just(-(1 << 63))
# What the client decodes it allocates: small dimensions only.
SMALL_DIMS = st.integers(0, 4)
ANY_SMALL_DIMS = SMALL_DIMS | st.just(-1)
ANY_SPECS = specs(VALID_DIMS, valid=True) | specs(ANY_DIMS, valid=False)


@st.composite
def update_entries(draw: st.DrawFn, valid: bool) -> pb.UpdateEntry:
    """An entry; valid with data, its num_chunks is left to the test (the frames it sends)."""
    entry = pb.UpdateEntry(
        mm_hash=draw(NAMES if valid else NAMES | BAD_NAMES),
        modality=draw(NAMES | st.just("") if valid else BAD_NAMES),
        want_metadata=draw(st.booleans()),
    )
    if draw(st.booleans()):
        entry.item.CopyFrom(draw(specs(VALID_DIMS, valid=True) if valid else ANY_SPECS))
    if not valid or entry.HasField("item"):  # a hash alone carries none of these
        entry.withheld = draw(st.booleans())
        entry.resend = draw(st.booleans())
        entry.metadata = draw(st.binary(max_size=4))
    if not valid:
        entry.num_chunks = draw(st.integers(0, 6) | st.just((1 << 32) - 1))
    return entry


@st.composite
def requests(draw: st.DrawFn) -> pb.UpdateRequest:
    valid = draw(st.booleans())
    return pb.UpdateRequest(
        touches=draw(st.lists(NAMES if valid else NAMES | BAD_NAMES, max_size=2)),
        entries=draw(st.lists(update_entries(valid), max_size=3)),
        lease=cast(
            "pb.LeaseMode.ValueType",
            draw(st.sampled_from([0, 1, 2]) if valid else st.integers(-1, 4)),
        ),
    )


def check_accepted(received: Received) -> None:
    """Whatever the server accepts is consistent, and the client can decode it."""
    request, entries, uploads = received
    event(f"accepted, {sum(u.item is not None for u in uploads)} items with data")
    assert len(entries) == len(uploads) == len(request.entries)
    for entry, upload in zip(entries, uploads, strict=True):
        check_name("mm_hash", entry.mm_hash)
        if upload.item is None:
            continue
        spec = pb.ItemSpec.FromString(upload.item.spec)  # kept as it came
        size = item_size(spec)
        assert entry.chunks == len(upload.item.frames)
        assert all(
            0 < len(f) - chunk_payload_offset(f) <= MAX_CHUNK_BYTES for f in upload.item.frames
        )
        assert len(payload_of(upload.item.frames)) == size.payload == upload.item.payload
        assert upload.item.size == size.charged + len(upload.item.metadata)
        # Held, it would go back verbatim in a Fetch: the client must be able to read it.
        decode_item(Spec(spec), upload.item.frames)


def chunk_frames(data: st.DataObject, total: int, exact: bool = False) -> list[bytes]:
    """`total` random payload bytes cut at random into chunk frames: `exact`, as
    a client cuts them; else now and then a byte too many or an empty chunk."""
    if not exact and data.draw(st.booleans()):
        total += 1
    payload = data.draw(st.binary(min_size=total, max_size=total))
    cuts = sorted(data.draw(st.lists(st.integers(0, total), max_size=4)))
    bounds = [0, *cuts, total]
    return [
        chunk_prefix(end - start) + payload[start:end]
        for start, end in itertools.pairwise(bounds)
        if end > start or (not exact and data.draw(st.booleans()))
    ]


@SETTINGS
@given(request=requests(), data=st.data(), in_metadata=st.booleans())
def test_any_update_request_gets_an_mmcache_error_or_a_consistent_upload(
    request: pb.UpdateRequest, data: st.DataObject, in_metadata: bool
) -> None:
    frames: list[bytes] = []
    for entry in request.entries:
        try:
            total = item_size(entry.item).payload if entry.HasField("item") else 0
        except InvalidArgumentError:
            total = 0
        sends = not entry.withheld or data.draw(st.booleans())
        if entry.HasField("item") and sends and total <= 256:
            exact = data.draw(st.booleans())
            sent = chunk_frames(data, total, exact)
            if exact or data.draw(st.booleans()):
                entry.num_chunks = len(sent)
            frames += sent
    header = request.SerializeToString()
    try:
        if in_metadata:
            received = server_reads(frames, header)
        else:
            received = server_reads([header_frame(header), *frames])
    except MMCacheError as exc:
        event(f"refused: {type(exc).__name__}")
        return
    check_accepted(received)


@SETTINGS
@given(
    frames=st.lists(st.binary(max_size=24), max_size=4),
    metadata=st.none() | st.binary(max_size=24),
)
def test_arbitrary_bytes_get_an_mmcache_error_or_a_consistent_upload(
    frames: list[bytes], metadata: bytes | None
) -> None:
    try:
        received = server_reads(frames, metadata)
    except MMCacheError as exc:
        event(f"refused: {type(exc).__name__}")
        return
    check_accepted(received)


# -- robustness: random mutations of valid uploads --------------------------------


MUTATIONS = st.lists(
    st.tuples(
        st.sampled_from(["flip", "cut", "insert", "drop", "repeat", "swap", "append"]),
        st.integers(0, 1 << 16),
        st.integers(0, 1 << 16),
        st.binary(min_size=1, max_size=6),
    ),
    min_size=1,
    max_size=3,
)


def mutate(parts: list[bytes], mutations: list[tuple[str, int, int, bytes]]) -> list[bytes]:
    """Apply byte- and frame-level mutations; indices wrap around what is there."""
    parts = list(parts)
    for op, i, j, junk in mutations:
        if op == "append" or not parts:
            parts.append(junk)
            continue
        i %= len(parts)
        part = parts[i]
        if op == "flip" and part:
            k = j % len(part)
            parts[i] = part[:k] + bytes((part[k] ^ (junk[0] | 1),)) + part[k + 1 :]
        elif op == "cut":
            parts[i] = part[: j % (len(part) + 1)]
        elif op == "insert":
            k = j % (len(part) + 1)
            parts[i] = part[:k] + junk + part[k:]
        elif op == "drop":
            del parts[i]
        elif op == "repeat":
            parts.insert(i, part)
        elif op == "swap":
            k = j % len(parts)
            parts[i], parts[k] = parts[k], parts[i]
    return parts


@SETTINGS
@given(
    batch=st.lists(items(), min_size=1, max_size=2),
    chunk_bytes=st.integers(1, 16),
    in_metadata=st.booleans(),
    mutations=MUTATIONS,
)
def test_mutated_uploads_get_an_mmcache_error_or_a_consistent_upload(
    batch: list[Item],
    chunk_bytes: int,
    in_metadata: bool,
    mutations: list[tuple[str, int, int, bytes]],
) -> None:
    request = pb.UpdateRequest()
    chunks: list[bytes] = []
    for n, item in enumerate(batch):
        encoded = encode_item(item)
        frames = list(iter_chunk_frames(encoded, chunk_bytes))
        request.entries.add(mm_hash=f"h{n}", item=encoded.spec.message, num_chunks=len(frames))
        chunks += frames
    header = request.SerializeToString()
    parts = mutate([header if in_metadata else header_frame(header), *chunks], mutations)
    try:
        if in_metadata:
            received = server_reads(parts[1:], parts[0] if parts else b"")
        else:
            received = server_reads(parts)
    except MMCacheError as exc:
        event(f"refused: {type(exc).__name__}")
        return
    check_accepted(received)


# -- robustness: the client's decoder ---------------------------------------------


@SETTINGS
@given(spec=specs(SMALL_DIMS, valid=True) | specs(ANY_SMALL_DIMS, valid=False), data=st.data())
def test_any_spec_and_frames_decode_or_get_an_mmcache_error(
    spec: pb.ItemSpec, data: st.DataObject
) -> None:
    try:
        total = item_size(spec).payload
    except InvalidArgumentError:
        total = data.draw(st.integers(0, 8))
    frames = chunk_frames(data, total, exact=data.draw(st.booleans()))
    frames = mutate(frames, data.draw(MUTATIONS)) if data.draw(st.booleans()) else frames
    try:
        item = decode_item(Spec(spec), frames)
    except MMCacheError as exc:
        event(f"refused: {type(exc).__name__}")
        return
    event("decoded")
    # Accepted: encoding the item gives back that spec and those bytes. A
    # mapping keeps no modality or field kind, whatever the spec said of them.
    expected = pb.ItemSpec()
    expected.CopyFrom(spec)
    for elem in expected.fields:
        if spec.form == pb.ItemSpec.FORM_MAPPING:
            for name in ("modality", "batched", "flat", "shared", "keep_on_cpu"):
                elem.ClearField(name)
        for entry in elem.flat.slices:
            if entry.WhichOneof("kind") is None:  # read as an empty tuple of slices
                entry.tuple.SetInParent()
    encoded = encode_item(item)
    assert encoded.spec.message == expected
    assert payload_of(iter_chunk_frames(encoded, 7)) == payload_of(frames)


# -- the frame primitives, against protobuf's own parser --------------------------


@st.composite
def frame_like(draw: st.DrawFn) -> bytes:
    """A tag byte, a varint of 1 to 11 bytes (overlong ones too), then junk."""
    tag = draw(st.sampled_from([CHUNK_TAG, HEADER_TAG]) | st.integers(0, 255))
    varint = [*draw(st.lists(st.integers(0x80, 0xFF), max_size=10)), draw(st.integers(0, 0x7F))]
    return bytes((tag, *varint)) + draw(st.binary(max_size=20))


FRAMES = st.binary(max_size=24) | frame_like()


@CHEAP
@given(n=st.integers(0, (1 << 64) - 1), rest=st.binary(max_size=4))
def test_varints_written_are_read_back_up_to_protobufs_five_bytes(n: int, rest: bytes) -> None:
    prefix = chunk_prefix(n)
    assert len(prefix) == 1 + max(1, -(-n.bit_length() // 7))
    if len(prefix) > 6:  # a length protobuf's own parsers refuse: so do we
        with pytest.raises(InvalidArgumentError):
            read_varint(prefix + rest, 1)
    else:
        assert read_varint(prefix + rest, 1) == (len(prefix), n)


@CHEAP
@given(frame=FRAMES, pos=st.integers(0, 30))
def test_read_varint_reads_or_gets_an_mmcache_error(frame: bytes, pos: int) -> None:
    try:
        end, n = read_varint(frame, pos)
    except InvalidArgumentError:
        assert all(b & 0x80 for b in frame[pos : pos + 5])  # no last byte within reach
        return
    assert pos < end <= min(len(frame), pos + 5)
    assert frame[end - 1] < 0x80 and all(b & 0x80 for b in frame[pos : end - 1])
    assert n == sum((b & 0x7F) << (7 * k) for k, b in enumerate(frame[pos:end]))


@CHEAP
@given(payload=st.binary(max_size=300))
def test_chunk_frames_are_what_protobuf_writes(payload: bytes) -> None:
    frame = chunk_prefix(len(payload)) + payload
    assert frame == pb.UpdateFrame(chunk=payload).SerializeToString()
    assert frame[chunk_payload_offset(frame) :] == payload


@CHEAP
@given(frame=FRAMES)
def test_a_chunk_frame_accepted_by_hand_is_one_protobuf_reads_alike(frame: bytes) -> None:
    try:
        pos = chunk_payload_offset(frame)
    except InvalidArgumentError:
        return
    assert frame[0] == CHUNK_TAG and 2 <= pos <= len(frame)
    if pos <= 6:  # protobuf (upb) takes lengths of at most 5 varint bytes
        parsed = pb.UpdateFrame.FromString(frame)
        assert parsed.WhichOneof("frame") == "chunk" and parsed.chunk == frame[pos:]


@CHEAP
@given(frame=FRAMES)
def test_a_header_frame_accepted_by_hand_holds_the_header_alone(frame: bytes) -> None:
    try:
        body = header_frame_body(frame, "the frame")
    except InvalidArgumentError:
        return
    assert frame[0] == HEADER_TAG and frame.endswith(body)
    if len(frame) - len(body) <= 6:
        try:
            parsed = pb.UpdateFrame.FromString(frame)
        except DecodeError:
            with pytest.raises(DecodeError):
                pb.UpdateRequest.FromString(body)
            return
        assert parsed.WhichOneof("frame") == "header"
        assert parsed.header == pb.UpdateRequest.FromString(body)


@CHEAP
@given(header=st.binary(max_size=300), touches=st.lists(NAMES, max_size=40))
def test_header_frames_are_what_protobuf_writes(header: bytes, touches: list[str]) -> None:
    assert header_frame_body(header_frame(header), "the frame") == header
    request = pb.UpdateRequest(touches=touches)
    framed = header_frame(request.SerializeToString())
    assert framed == pb.UpdateFrame(header=request).SerializeToString()


@CHEAP
@given(
    name=st.text(NAME_CHARS, max_size=8) | st.integers(0, MAX_NAME_CHARS + 2).map("n".__mul__),
    allow_empty=st.booleans(),
)
def test_check_name_accepts_exactly_the_names_within_bounds(name: str, allow_empty: bool) -> None:
    ok = (allow_empty or name != "") and len(name) <= MAX_NAME_CHARS
    try:
        check_name("name", name, allow_empty=allow_empty)
    except InvalidArgumentError:
        assert not ok
    else:
        assert ok


# -- bugs the properties found, each fixed -----------------------------------------


def test_a_flat_field_whose_slices_are_no_sequence_is_an_invalid_argument() -> None:
    item = MMItem.from_elems([FieldElem("image", "k", torch.ones(1), FlatField(slices=None))])  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        encode_item(item)


def test_a_spec_larger_than_memory_is_refused_by_an_mmcache_error() -> None:
    spec = pb.ItemSpec(form=pb.ItemSpec.FORM_MAPPING)
    spec.fields.add(key="k").data.tensor.CopyFrom(pb.TensorSpec(dtype="uint8", shape=[1 << 24] * 2))
    with pytest.raises(MMCacheError):
        ItemDecoder(Spec(spec))


def test_a_fetch_reply_whose_header_does_not_parse_is_an_invalid_argument() -> None:
    with pytest.raises(InvalidArgumentError):
        drive(read_fetch(in_memory([b"\xff"]), 1))


def test_a_fetch_reply_with_too_few_chunks_is_an_invalid_argument() -> None:
    fetched = pb.FetchHeader(instance_id="i")
    encoded = encode_item({"k": torch.ones(4)})
    fetched.items.add(mm_hash="h", item=encoded.spec.message, num_chunks=2)
    with pytest.raises(InvalidArgumentError):
        drive(read_fetch(in_memory([fetched.SerializeToString()]), 1))


def test_nested_equal_compares_contiguous_tensors_of_any_strides() -> None:
    column = torch.arange(5, dtype=torch.bfloat16).reshape(1, 5)[:, 2]  # (1,), stride 5
    assert column.is_contiguous() and column.stride() == (5,)
    assert nested_equal(column, torch.tensor([2], dtype=torch.bfloat16))


def test_the_server_refuses_an_empty_tensor_no_client_could_decode() -> None:
    spec = pb.ItemSpec(form=pb.ItemSpec.FORM_MAPPING)
    shape = [0, (1 << 63) - 1, 2]  # no bytes, but torch's strides would overflow
    spec.fields.add(key="k").data.tensor.CopyFrom(pb.TensorSpec(dtype="int64", shape=shape))
    request = pb.UpdateRequest(entries=[pb.UpdateEntry(mm_hash="h", item=spec, num_chunks=0)])
    with pytest.raises(InvalidArgumentError, match="strides would overflow"):
        server_reads([header_frame(request.SerializeToString())])


def test_a_key_no_utf_8_can_carry_is_an_invalid_argument() -> None:
    with pytest.raises(InvalidArgumentError):
        encode_item({"\ud800": 1})
