"""Torch items to and from their wire form: an `ItemSpec` plus chunk frames.

The spec carries the structure (keys, field kinds, dtypes, shapes, scalars);
the frames carry the tensor bytes, depth first, fields in order, cut into
chunks. This is the transport's hot path, so the tensor bytes are copied
exactly once each way: into a frame's `bytes` on encode (grpc's raw path
takes nothing else), and out of the frames into a fresh tensor on decode.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from mmcache._dtypes import ITEMSIZE
from mmcache._errors import InvalidArgumentError, ResourceExhaustedError
from mmcache._frames import chunk_payload_offset, chunk_prefix
from mmcache._items import Item
from mmcache._memory import advise_hugepages, prefault_in_background
from mmcache._spec import SpecSize

from ._pool import MIN_POOLED_BYTES, BufferPool
from .wire import Spec, TensorLeaf, describe

__all__ = [
    "EncodedItem",
    "ItemDecoder",
    "checked_leaves",
    "copy_payload",
    "decode_item",
    "encode_item",
    "iter_chunk_frames",
    "leaf_buffer",
    "num_chunks",
    "shaped",
    "view_item",
]

# Fetched tensors from this size up have their pages faulted in on a helper
# thread while their frames arrive (smaller ones mostly reuse freed memory).
_PREFAULT_BYTES = 32 << 20


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

    spec: Spec
    size: SpecSize  # spec.size: what both sides charge
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
    tensors: list[torch.Tensor] = []

    def leaf(key: str, data: object) -> tuple[str, Sequence[int]] | None:
        if not isinstance(data, torch.Tensor):
            return None
        tensor = _leaf(key, data)
        tensors.append(tensor)
        return str(tensor.dtype).removeprefix("torch."), tensor.shape

    spec, common = describe(item, leaf)
    return EncodedItem(spec, spec.size, common or modality or "", tuple(tensors))


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


def decode_item(spec: Spec, frames: Sequence[bytes]) -> Item:
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

    def __init__(self, spec: Spec, pool: BufferPool | None = None) -> None:
        self._spec = spec
        self._total = spec.size.payload
        self._buffers: list[tuple[torch.Tensor, memoryview]] = []
        large: list[tuple[int, int]] = []
        for tensor_leaf in checked_leaves(spec):
            n = tensor_leaf.nbytes
            # Allocated as bytes and viewed as the dtype at the end: the
            # same fresh storage, and no "experimental" warning for complex32.
            try:
                raw, fresh = leaf_buffer(n, pool)
            except (RuntimeError, MemoryError):
                raise ResourceExhaustedError(
                    f"cannot allocate {n} bytes for a {tensor_leaf.dtype} tensor of "
                    f"field {tensor_leaf.key!r}"
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
        return self._spec.assemble(iter(raw for raw, _ in self._buffers), shaped)


def view_item(spec: Spec, payload: memoryview) -> Item:
    """The item with its tensors as views of `payload`: no copy, valid only while
    `payload`'s memory is (a shared-memory slot under its lease).

        item = view_item(fetched.item, slot_view)
    """
    size = spec.size
    if len(payload) != size.payload:
        raise InvalidArgumentError(
            f"the item's tensors need {size.payload} bytes, the view holds {len(payload)}"
        )
    leaves: list[torch.Tensor] = []
    pos = 0
    for tensor_leaf in checked_leaves(spec):
        n = tensor_leaf.nbytes
        if n:
            leaves.append(torch.frombuffer(payload, dtype=torch.uint8, count=n, offset=pos))
        else:
            leaves.append(torch.empty(0, dtype=torch.uint8))
        pos += n
    return spec.assemble(iter(leaves), shaped)


def checked_leaves(spec: Spec) -> tuple[TensorLeaf, ...]:
    """Each tensor leaf of `spec` in payload order; InvalidArgumentError for a
    spec that is not valid, or a dtype this torch lacks."""
    spec.size  # noqa: B018 (checks the spec)
    leaves = spec.leaves()
    for tensor_leaf in leaves:
        if tensor_leaf.dtype not in _DTYPES:
            raise InvalidArgumentError(
                f"this torch ({torch.__version__}) has no dtype {tensor_leaf.dtype}"
            )
    return leaves


def shaped(raw: torch.Tensor, tensor_leaf: TensorLeaf) -> torch.Tensor:
    """A filled leaf's bytes as its tensor."""
    return raw.view(_DTYPES[tensor_leaf.dtype]).reshape(tensor_leaf.shape)


# -- encoding ---------------------------------------------------------------


def _check_chunk_bytes(chunk_bytes: int) -> None:
    if chunk_bytes < 1:
        raise InvalidArgumentError(f"chunk_bytes must be at least 1, got {chunk_bytes}")


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
