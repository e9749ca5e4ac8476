"""Items read straight out of shared memory, decoded by a plan made once per spec.

An engine reads items of a few shapes over and over (one per image size), and
their specs are the same bytes each time. Working a spec out (parsing it,
checking it, sizing and typing each tensor, decoding each field) cost more
than copying a 1.2 MB item's bytes, so a plan of it is kept, by the spec's
bytes: a read is then one lookup, one allocation and one copy per tensor,
and the item's objects.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from mmcache._errors import MMCacheError
from mmcache._items import Field, FieldElem, Item, MMItem

from .._codec import _DTYPES, checked_leaves, leaf_buffer
from .._pool import MIN_POOLED_BYTES, BufferPool
from ..wire import Spec, parse_spec

__all__ = ["decode_from_region", "modality_of"]

MAX_PLANS = 256  # distinct specs kept (a few hundred bytes each)


@dataclass(frozen=True, slots=True)
class _Plan:
    spec: Spec
    payload: int
    leaves: tuple[tuple[int, torch.dtype, tuple[int, ...]], ...]  # bytes, dtype, shape
    # (key, modality, field) per field, where every field's data is one tensor
    # of an MMItem: the item is built from them with no walk of the spec.
    flat: tuple[tuple[str, str, Field], ...] | None


_plans: OrderedDict[bytes, _Plan] = OrderedDict()
_lock = threading.Lock()  # engines read on their own threads


def _plan(spec_bytes: bytes) -> _Plan:
    with _lock:
        plan = _plans.get(spec_bytes)
        if plan is not None:
            _plans.move_to_end(spec_bytes)
            return plan
    spec = parse_spec(spec_bytes)
    leaves = tuple((t.nbytes, _DTYPES[t.dtype], t.shape) for t in checked_leaves(spec))
    plan = _Plan(spec, spec.size.payload, leaves, spec.flat_fields())
    with _lock:
        _plans[spec_bytes] = plan
        while len(_plans) > MAX_PLANS:
            _plans.popitem(last=False)
    return plan


def modality_of(spec_bytes: bytes) -> str:
    """An item's own modality (its first field's), as the server labels a
    lookup's hit; "" for a spec that is not one. By the plan: no parse again."""
    try:
        return _plan(spec_bytes).spec.modality
    except MMCacheError:
        return ""


def decode_from_region(
    spec_bytes: bytes, payload: memoryview, pool: BufferPool | None
) -> tuple[Item, int] | None:
    """The item of `spec_bytes` with its tensors copied out of `payload` (fresh
    tensors, the caller's own), and its payload bytes; None when the spec is
    not one (or does not match the payload's length), or memory for the
    tensors cannot be had: the caller reads the item by call, which says why."""
    try:
        plan = _plan(spec_bytes)
    except MMCacheError:
        return None
    if plan.payload != len(payload):
        return None
    tensors: list[torch.Tensor] = []
    pos = 0
    for n, dtype, shape in plan.leaves:
        tensor = _copied(payload[pos : pos + n], dtype, shape, pool)
        if tensor is None:
            return None
        tensors.append(tensor)
        pos += n
    if plan.flat is None:
        return plan.spec.assemble(iter(tensors), _as_is), plan.payload
    item = MMItem(
        {
            key: FieldElem(modality, key, tensor, field)
            for (key, modality, field), tensor in zip(plan.flat, tensors, strict=True)
        }
    )
    return item, plan.payload


def _copied(
    piece: memoryview, dtype: torch.dtype, shape: tuple[int, ...], pool: BufferPool | None
) -> torch.Tensor | None:
    """A leaf's bytes copied out of the region as its tensor (None: no memory
    for it). A small one is copied into a bytearray the tensor wraps: two
    torch calls instead of four, and a region hit of a small image is mostly
    such calls (a 19 KiB item's three leaves: 19 against 9 µs hot)."""
    n = len(piece)
    try:
        if 0 < n < MIN_POOLED_BYTES:
            return torch.frombuffer(bytearray(piece), dtype=dtype).reshape(shape)
        raw, _ = leaf_buffer(n, pool)
    except (RuntimeError, MemoryError):
        return None
    raw.numpy().data[:] = piece
    return raw.view(dtype).reshape(shape)


def _as_is(tensor: torch.Tensor, _: object) -> torch.Tensor:
    return tensor  # typed and shaped as it was copied
