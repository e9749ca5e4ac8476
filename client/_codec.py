"""Torch items to and from their wire form: an `ItemSpec` plus chunk frames.

The spec carries the structure (keys, field kinds, dtypes, shapes, scalars);
the frames carry the tensor bytes, depth first, fields in order, cut into
chunks. This is the transport's hot path, so the tensor bytes are copied
exactly once each way: into a frame's `bytes` on encode (grpc's raw path
takes nothing else), and out of the frames into a fresh tensor on decode.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, SupportsIndex

import torch

from mmcache._dtypes import ITEMSIZE, nbytes_of
from mmcache._errors import InvalidArgumentError, ResourceExhaustedError
from mmcache._frames import chunk_payload_offset, chunk_prefix
from mmcache._items import (
    BatchedField,
    Field,
    FieldElem,
    FlatField,
    Item,
    MMItem,
    NestedData,
    SharedField,
)
from mmcache._memory import advise_hugepages, prefault_in_background
from mmcache._spec import MAX_DEPTH, SpecSize, check_name, item_size
from mmcache.v1 import cache_pb2 as pb

from ._pool import MIN_POOLED_BYTES, BufferPool

__all__ = [
    "EncodedItem",
    "ItemDecoder",
    "copy_payload",
    "decode_item",
    "encode_item",
    "iter_chunk_frames",
    "leaf_buffer",
    "num_chunks",
    "view_item",
]

# Fetched tensors from this size up have their pages faulted in on a helper
# thread while their frames arrive (smaller ones mostly reuse freed memory).
_PREFAULT_BYTES = 32 << 20

_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1


def _torch_dtypes() -> dict[str, torch.dtype]:
    # An older torch lacks the newest float8/float4 dtypes: leave them out.
    found = {name: getattr(torch, name, None) for name in ITEMSIZE}
    return {name: dtype for name, dtype in found.items() if isinstance(dtype, torch.dtype)}


_DTYPES = _torch_dtypes()  # torch.dtype by wire name


@dataclass(frozen=True, slots=True)
class EncodedItem:
    """An item ready to send: its spec, its size and its tensor leaves.

    Made by `encode_item`, sent with `num_chunks` and `iter_chunk_frames`:

        enc = encode_item(item)
        frames = iter_chunk_frames(enc, DEFAULT_CHUNK_BYTES)
    """

    spec: pb.ItemSpec
    size: SpecSize  # item_size(spec): what both sides charge
    modality: str  # the item's own, else the caller's, else ""
    tensors: tuple[torch.Tensor, ...]  # contiguous CPU leaves, in payload order


def encode_item(item: Item, *, modality: str | None = None) -> EncodedItem:
    """Describe `item` as an `ItemSpec` and collect its tensor leaves.

    An `MMItem` (or any mapping whose values are all `FieldElem`s) keeps its
    field kinds and modalities (FORM_ITEM); any other mapping is stored as
    plain {key: data} (FORM_MAPPING). Tensors on another device are copied to
    CPU; non-contiguous ones travel as their contiguous values. Raises
    InvalidArgumentError naming the key at fault for data it cannot carry.

        enc = encode_item({"pixel_values": torch.rand(3, 224, 224)}, modality="image")
        enc.size.charged  # bytes the cache will charge for it
    """
    if not isinstance(item, Mapping):
        raise InvalidArgumentError(
            f"an item is a mapping of key -> data or an MMItem, not {type(item).__name__}"
        )
    as_item = isinstance(item, MMItem) or (
        bool(item) and all(isinstance(v, FieldElem) for v in item.values())
    )
    spec = pb.ItemSpec(form=pb.ItemSpec.FORM_ITEM if as_item else pb.ItemSpec.FORM_MAPPING)
    tensors: list[torch.Tensor] = []
    modalities: set[str] = set()
    for key, value in item.items():
        if not isinstance(key, str):
            raise InvalidArgumentError(f"item keys must be str, got {type(key).__name__} {key!r}")
        check_name("item key", key)
        elem = spec.fields.add(key=key)
        data: object = value
        if as_item:
            if not isinstance(value, FieldElem):
                raise InvalidArgumentError(
                    f"field {key!r} of an MMItem must be a FieldElem, got {type(value).__name__}"
                )
            if value.key != key:
                raise InvalidArgumentError(f"field {key!r} holds a FieldElem keyed {value.key!r}")
            if not isinstance(value.modality, str):
                raise InvalidArgumentError(f"the modality of field {key!r} must be a str")
            elem.modality = value.modality
            modalities.add(value.modality)
            _encode_field(key, value.field, elem)
            data = value.data
        _encode_node(key, data, elem.data, tensors, 0)
    size = item_size(spec)
    common = modalities.pop() if len(modalities) == 1 else ""
    return EncodedItem(spec, size, common or modality or "", tuple(tensors))


def num_chunks(encoded: EncodedItem, chunk_bytes: int) -> int:
    """How many frames `iter_chunk_frames(encoded, chunk_bytes)` yields."""
    _check_chunk_bytes(chunk_bytes)
    return -(-encoded.size.payload // chunk_bytes)


def iter_chunk_frames(encoded: EncodedItem, chunk_bytes: int) -> Iterator[bytes]:
    """Yield the item's payload as chunk frames of `chunk_bytes` (the last may be short).

    Each frame is one `bytes` (prefix + payload piece) and frames are made one
    at a time, so a large item is never duplicated whole in memory. Pieces of
    several small leaves share a frame; a large leaf spans several frames.

        for frame in iter_chunk_frames(enc, 1 << 20):
            send(frame)
    """
    _check_chunk_bytes(chunk_bytes)
    full_prefix = chunk_prefix(chunk_bytes)
    pieces: list[bytes | memoryview] = [full_prefix]
    filled = 0
    for tensor in encoded.tensors:
        view = _byte_view(tensor)
        pos, end = 0, len(view)
        while pos < end:
            take = min(chunk_bytes - filled, end - pos)
            pieces.append(view[pos : pos + take])
            pos += take
            filled += take
            if filled == chunk_bytes:
                yield b"".join(pieces)
                pieces = [full_prefix]
                filled = 0
    if filled:
        pieces[0] = chunk_prefix(filled)
        yield b"".join(pieces)


def copy_payload(encoded: EncodedItem, into: memoryview) -> None:
    """Copy the item's payload (its tensors' bytes, in order) into `into`, on
    this thread alone (as every copy here: see `ItemDecoder.feed_payload`)."""
    pos = 0
    for tensor in encoded.tensors:
        view = _byte_view(tensor)
        into[pos : pos + len(view)] = view
        pos += len(view)


def decode_item(spec: pb.ItemSpec, frames: Sequence[bytes]) -> Item:
    """Rebuild an item from its spec and chunk frames, in the form it was stored.

    Returns an `MMItem` for FORM_ITEM and a plain dict for FORM_MAPPING. Each
    tensor is freshly allocated, contiguous and writable. Raises
    InvalidArgumentError when the spec is invalid or the frames do not carry
    exactly its payload.

        item = decode_item(fetched.item, frames)
    """
    decoder = ItemDecoder(spec)
    for frame in frames:
        decoder.feed(frame)
    return decoder.finish()


def leaf_buffer(n: int, pool: BufferPool | None) -> tuple[torch.Tensor, bool]:
    """Bytes for one tensor a read fills, the caller's own: from the pool when
    large enough (memory a dropped tensor left, pages mapped), else fresh (huge
    pages asked for); and whether fresh. RuntimeError or MemoryError when the
    memory cannot be had."""
    if pool is not None and n >= MIN_POOLED_BYTES:
        return pool.take(n), False
    raw = torch.empty(n, dtype=torch.uint8)
    advise_hugepages(raw.data_ptr(), n)
    return raw, True


class ItemDecoder:
    """Rebuilds one item while its chunk frames arrive, one frame at a time.

    The tensors are allocated from the spec up front and each frame is copied
    into them as it comes, so a frame can be dropped at once: the client never
    holds an item's bytes twice.

        decoder = ItemDecoder(spec)
        for frame in frames:
            decoder.feed(frame)
        item = decoder.finish()
    """

    __slots__ = ("_buffers", "_leaf", "_pos", "_received", "_spec", "_total")

    def __init__(self, spec: pb.ItemSpec, pool: BufferPool | None = None) -> None:
        self._spec = spec
        self._total = item_size(spec).payload
        self._buffers: list[tuple[torch.Tensor, memoryview]] = []
        large: list[tuple[int, int]] = []
        for elem, tensor_spec, n in _leaves(spec):
            # Allocated as bytes and viewed as the dtype at the end: the
            # same fresh storage, and no "experimental" warning for complex32.
            try:
                raw, fresh = leaf_buffer(n, pool)
            except (RuntimeError, MemoryError):
                raise ResourceExhaustedError(
                    f"cannot allocate {n} bytes for a {tensor_spec.dtype} tensor of "
                    f"field {elem.key!r}"
                ) from None
            if fresh and n >= _PREFAULT_BYTES:
                large.append((raw.data_ptr(), n))
            self._buffers.append((raw, raw.numpy().data))
        prefault_in_background(large)
        self._leaf = 0
        self._pos = 0
        self._received = 0

    def feed(self, frame: bytes) -> None:
        """Copy one chunk frame's payload into the tensors."""
        self.feed_payload(memoryview(frame)[chunk_payload_offset(frame) :])

    def feed_payload(self, src: memoryview) -> None:
        """Copy the next payload bytes (from a frame, or shared memory) into the
        tensors, on this thread: torch's intra-op threads would copy a 1.2 MB
        item 15% sooner for 50 times the CPU (their spin after each copy:
        2.1 against 0.04 ms here), on an engine's or an API server's cores."""
        self._received += len(src)
        if self._received > self._total:
            raise InvalidArgumentError(
                f"the item's tensors need {self._total} bytes but its chunk frames carry more"
            )
        done = 0
        while done < len(src):
            dst = self._buffers[self._leaf][1]
            take = min(len(src) - done, len(dst) - self._pos)
            dst[self._pos : self._pos + take] = src[done : done + take]
            done += take
            self._pos += take
            if self._pos == len(dst):
                self._leaf += 1
                self._pos = 0

    def finish(self) -> Item:
        """The item, once every payload byte has been fed."""
        if self._received != self._total:
            raise InvalidArgumentError(
                f"the item's tensors need {self._total} bytes but its chunk frames "
                f"carry {self._received}"
            )
        return _assemble(self._spec, iter(raw for raw, _ in self._buffers))


def view_item(spec: pb.ItemSpec, payload: memoryview) -> Item:
    """The item with its tensors as views of `payload`: no copy, valid only while
    `payload`'s memory is (a shared-memory slot under its lease).

        item = view_item(fetched.item, slot_view)
    """
    size = item_size(spec)
    if len(payload) != size.payload:
        raise InvalidArgumentError(
            f"the item's tensors need {size.payload} bytes, the view holds {len(payload)}"
        )
    leaves: list[torch.Tensor] = []
    pos = 0
    for _, _, n in _leaves(spec):
        if n:
            leaves.append(torch.frombuffer(payload, dtype=torch.uint8, count=n, offset=pos))
        else:
            leaves.append(torch.empty(0, dtype=torch.uint8))
        pos += n
    return _assemble(spec, iter(leaves))


def _leaves(spec: pb.ItemSpec) -> Iterator[tuple[pb.FieldElem, pb.TensorSpec, int]]:
    """Each tensor leaf of `spec` in payload order, with its field and its bytes;
    InvalidArgumentError for a dtype this torch lacks."""
    for elem in spec.fields:
        for tensor_spec in _tensor_specs(elem.data):
            n = nbytes_of(tensor_spec.dtype, tensor_spec.shape)
            if tensor_spec.dtype not in _DTYPES:
                raise InvalidArgumentError(
                    f"this torch ({torch.__version__}) has no dtype {tensor_spec.dtype}"
                )
            yield elem, tensor_spec, n


def _assemble(spec: pb.ItemSpec, leaves: Iterator[torch.Tensor]) -> Item:
    """The item in the form it was stored, from its filled leaves in payload order."""
    if spec.form == pb.ItemSpec.FORM_ITEM:
        return MMItem(
            {
                elem.key: FieldElem(
                    elem.modality, elem.key, _build(elem.data, leaves), _decode_field(elem)
                )
                for elem in spec.fields
            }
        )
    return {elem.key: _build(elem.data, leaves) for elem in spec.fields}


# -- encoding ---------------------------------------------------------------


def _check_chunk_bytes(chunk_bytes: int) -> None:
    if chunk_bytes < 1:
        raise InvalidArgumentError(f"chunk_bytes must be at least 1, got {chunk_bytes}")


def _encode_node(
    key: str, data: object, node: pb.Node, tensors: list[torch.Tensor], depth: int
) -> None:
    # bool before int: True is an int to isinstance.
    if isinstance(data, torch.Tensor):
        tensor = _leaf(key, data)
        node.tensor.dtype = str(tensor.dtype).removeprefix("torch.")
        node.tensor.shape.extend(tensor.shape)
        tensors.append(tensor)
    elif isinstance(data, bool):
        node.bool_value = data
    elif isinstance(data, int):
        node.int_value = _int64(key, data, "an int")
    elif isinstance(data, float):
        node.float_value = data
    elif isinstance(data, list | tuple):
        if depth >= MAX_DEPTH:
            raise InvalidArgumentError(f"field {key!r} nests deeper than {MAX_DEPTH} levels")
        container = node.list if isinstance(data, list) else node.tuple
        container.SetInParent()  # so that an empty list or tuple is still one
        for child in data:
            _encode_node(key, child, container.items.add(), tensors, depth + 1)
    else:
        raise InvalidArgumentError(
            f"field {key!r} holds a {type(data).__module__}.{type(data).__qualname__}; "
            "item data must be tensors, ints, floats, bools, or lists/tuples of them"
        )


def _leaf(key: str, tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as a contiguous, plain CPU tensor whose bytes can be read."""
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in ITEMSIZE:
        raise InvalidArgumentError(
            f"field {key!r} holds a tensor of dtype {name}, which mmcache cannot carry; "
            f"supported: {', '.join(sorted(ITEMSIZE))}"
        )
    if tensor.layout != torch.strided:
        raise InvalidArgumentError(
            f"field {key!r} holds a {tensor.layout} tensor; convert it with .to_dense()"
        )
    if tensor.is_meta:
        raise InvalidArgumentError(f"field {key!r} holds a meta tensor, which has no data")
    tensor = tensor.detach()
    if tensor.dtype == torch.complex32 and not (tensor.is_conj() or tensor.is_neg()):
        # Allocating complex32 warns "experimental": copy it as float16 pairs.
        pairs = torch.view_as_real(tensor).cpu().contiguous()
        return pairs.view(torch.complex32).reshape(tensor.shape)
    # Conjugate and negative views carry a lazy flag, not the values: resolve them.
    return tensor.cpu().resolve_conj().resolve_neg().contiguous()


def _byte_view(tensor: torch.Tensor) -> memoryview:
    # Flat first (a 0-d tensor cannot be viewed as bytes of another size), by
    # strides: a contiguous tensor may keep any stride on a dimension of size 0
    # or 1 (t[::2] of a 1-element t), which reshape keeps and .view refuses.
    view: memoryview = tensor.as_strided((tensor.numel(),), (1,)).view(torch.uint8).numpy().data
    return view


def _int64(key: str, value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, SupportsIndex):
        raise InvalidArgumentError(
            f"field {key!r}: {what} must be an int, got {type(value).__name__}"
        )
    number = operator.index(value)
    if not _INT64_MIN <= number <= _INT64_MAX:
        raise InvalidArgumentError(
            f"field {key!r}: {what} {number} does not fit in int64 "
            f"[{_INT64_MIN}, {_INT64_MAX}]; store it as a tensor or a float"
        )
    return number


def _encode_field(key: str, field: object, elem: pb.FieldElem) -> None:
    elem.keep_on_cpu = bool(getattr(field, "keep_on_cpu", False))
    if isinstance(field, BatchedField):
        elem.batched.SetInParent()
    elif isinstance(field, SharedField):
        elem.shared.batch_size = _int64(key, field.batch_size, "SharedField.batch_size")
    elif isinstance(field, FlatField):
        elem.flat.dim = _int64(key, field.dim, "FlatField.dim")
        if not isinstance(field.slices, Sequence) or isinstance(field.slices, str | bytes):
            raise InvalidArgumentError(
                f"field {key!r}: FlatField.slices is a {type(field.slices).__name__}; "
                "give a list of slices (or tuples of slices)"
            )
        for entry in field.slices:
            out = elem.flat.slices.add()
            if isinstance(entry, slice):
                out.slice.SetInParent()  # so that slice(None), all unset, is still a slice
                _encode_slice(key, entry, out.slice)
            elif isinstance(entry, Sequence) and not isinstance(entry, str | bytes):
                out.tuple.SetInParent()
                for part in entry:
                    if not isinstance(part, slice):
                        raise InvalidArgumentError(
                            f"field {key!r}: a FlatField slice tuple holds a "
                            f"{type(part).__name__}, not a slice"
                        )
                    _encode_slice(key, part, out.tuple.slices.add())
            else:
                raise InvalidArgumentError(
                    f"field {key!r}: FlatField.slices holds a {type(entry).__name__}; "
                    "each entry is a slice or a tuple of slices"
                )
    else:
        raise InvalidArgumentError(
            f"field {key!r} has field kind {type(field).__name__}; "
            "expected BatchedField, FlatField or SharedField"
        )


def _encode_slice(key: str, s: slice, out: pb.Slice) -> None:
    # Unset optional members stand for None.
    if s.start is not None:
        out.start = _int64(key, s.start, "a slice start")
    if s.stop is not None:
        out.stop = _int64(key, s.stop, "a slice stop")
    if s.step is not None:
        out.step = _int64(key, s.step, "a slice step")


# -- decoding ---------------------------------------------------------------


def _tensor_specs(node: pb.Node) -> Iterator[pb.TensorSpec]:
    """The tensor leaves under `node`, in payload order (depth first)."""
    kind = node.WhichOneof("kind")
    if kind == "tensor":
        yield node.tensor
    elif kind in ("list", "tuple"):
        for child in node.list.items if kind == "list" else node.tuple.items:
            yield from _tensor_specs(child)


def _build(node: pb.Node, leaves: Iterator[torch.Tensor]) -> NestedData:
    """The data under `node`, taking filled tensor buffers in payload order."""
    kind = node.WhichOneof("kind")
    if kind == "tensor":
        return next(leaves).view(_DTYPES[node.tensor.dtype]).reshape(tuple(node.tensor.shape))
    if kind == "int_value":
        return int(node.int_value)
    if kind == "float_value":
        return float(node.float_value)
    if kind == "bool_value":
        return bool(node.bool_value)
    if kind == "list":
        return [_build(child, leaves) for child in node.list.items]
    # item_size has checked that every node has a kind.
    return tuple(_build(child, leaves) for child in node.tuple.items)


def _decode_field(elem: pb.FieldElem) -> Field:
    kind = elem.WhichOneof("field")
    keep_on_cpu = elem.keep_on_cpu
    if kind == "shared":
        return SharedField(batch_size=elem.shared.batch_size, keep_on_cpu=keep_on_cpu)
    if kind == "flat":
        slices: list[Any] = [
            _decode_slice(entry.slice)
            if entry.WhichOneof("kind") == "slice"
            else tuple(_decode_slice(s) for s in entry.tuple.slices)
            for entry in elem.flat.slices
        ]
        return FlatField(slices=slices, dim=elem.flat.dim, keep_on_cpu=keep_on_cpu)
    # item_size has checked that a FORM_ITEM field has a kind.
    return BatchedField(keep_on_cpu=keep_on_cpu)


def _decode_slice(s: pb.Slice) -> slice:
    return slice(
        s.start if s.HasField("start") else None,
        s.stop if s.HasField("stop") else None,
        s.step if s.HasField("step") else None,
    )
