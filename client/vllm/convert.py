"""vLLM's types to mmcache's and back: items, and prompt updates as data.

Items: a `MultiModalKwargsItem` (key -> `MultiModalFieldElem(data, field)`) is
an `MMItem` whose field kinds (batched, flat, shared, each with
`keep_on_cpu`) map one to one; the modality comes from the request.

Prompt updates: a P0 that gets a hit for an item it never processed needs
that item's `ResolvedPromptUpdate`s to place its tokens. They travel as the
item's metadata, in an explicit JSON schema, never pickled:

    {"v": 1, "updates": [{"modality": "image", "item_idx": 0,
                          "mode": "replace", "target": [151655],
                          "full": [151652, 151655, ...], "embed": [0, 1, ...]}]}

`target` is a token sequence, or a position vLLM's `PromptIndexTargets`
made: `{"index": "start"}`, `{"index": "end"}` or `{"index": "prefix",
"seq": [...]}` (PaliGemma, BLIP-2, ... insert at such positions). A
`PromptIndex` is a pair of closures: its kind is known by the code of its
closure (the same for every index one `PromptIndexTargets` method makes) and
a prefix's tokens read from it, then rebuilt by the same method on the other
side. `embed` is the result of the update's `is_embed(full)` (None: every
position is embedded), which is all vLLM ever asks of it for that content.
An update whose target is none of these cannot be described by data
(`encode_updates` returns None, `undescribed` says why): its items' updates
stay local to the process that made them.
"""

from __future__ import annotations

import functools
import json
import threading
import types
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from vllm.multimodal.inputs import (
    MultiModalBatchedField,
    MultiModalFieldElem,
    MultiModalFlatField,
    MultiModalKwargsItem,
    MultiModalSharedField,
)
from vllm.multimodal.processing.processor import (
    PromptIndex,
    PromptIndexTargets,
    PromptUpdateDetails,
    ResolvedPromptUpdate,
    UpdateMode,
)

from mmcache._errors import InvalidArgumentError
from mmcache._items import BatchedField, Field, FieldElem, FlatField, Item, MMItem, SharedField

__all__ = ["decode_updates", "encode_updates", "from_vllm", "to_vllm", "undescribed"]

SCHEMA_VERSION = 1


def from_vllm(item: MultiModalKwargsItem, modality: str) -> MMItem:
    """vLLM's item as an MMItem (the tensors are shared, not copied)."""
    return MMItem(
        {
            key: FieldElem(modality, key, elem.data, _field_from_vllm(elem.field))
            for key, elem in item.items()
        }
    )


def item_nbytes(data: Any) -> int:
    """The tensor bytes of vLLM's item (or of a field's nested tensors)."""
    if isinstance(data, torch.Tensor):
        return data.nbytes
    if isinstance(data, MultiModalKwargsItem):
        return sum(item_nbytes(elem.data) for elem in data.values())
    if isinstance(data, list | tuple):
        return sum(item_nbytes(part) for part in data)
    return 0


def to_vllm(item: Item) -> MultiModalKwargsItem:
    """A fetched MMItem as vLLM's item."""
    if not isinstance(item, MMItem):
        raise InvalidArgumentError("the cache holds a plain mapping where vLLM stores items")
    return MultiModalKwargsItem(
        {
            key: MultiModalFieldElem(data=elem.data, field=_field_to_vllm(elem.field))
            for key, elem in item.items()
        }
    )


def _field_from_vllm(field: Any) -> Field:
    if isinstance(field, MultiModalFlatField):
        return FlatField(slices=field.slices, dim=field.dim, keep_on_cpu=field.keep_on_cpu)
    if isinstance(field, MultiModalSharedField):
        return SharedField(batch_size=field.batch_size, keep_on_cpu=field.keep_on_cpu)
    if isinstance(field, MultiModalBatchedField):
        return BatchedField(keep_on_cpu=field.keep_on_cpu)
    raise InvalidArgumentError(f"vLLM field kind {type(field).__name__} has no mmcache form")


def _field_to_vllm(field: Field) -> Any:
    if isinstance(field, FlatField):
        return MultiModalFlatField(
            slices=field.slices, dim=field.dim, keep_on_cpu=field.keep_on_cpu
        )
    if isinstance(field, SharedField):
        return MultiModalSharedField(batch_size=field.batch_size, keep_on_cpu=field.keep_on_cpu)
    return MultiModalBatchedField(keep_on_cpu=field.keep_on_cpu)


# The code of each kind of index PromptIndexTargets makes (closures of one
# function share it), to know an index's kind without calling it.
_START = PromptIndexTargets.start().get_match_index.__code__
_END = PromptIndexTargets.end().get_match_index.__code__
_PREFIX = PromptIndexTargets.prefix([]).get_match_index.__code__


def _describe_target(target: Any) -> list[int] | dict[str, Any] | None:
    if isinstance(target, list):
        return [int(t) for t in target]
    if not isinstance(target, PromptIndex):
        return None
    code = getattr(target.get_match_index, "__code__", None)
    if code is _START:
        return {"index": "start"}
    if code is _END:
        return {"index": "end"}
    if code is _PREFIX and target.get_match_index.__closure__ is not None:
        cells = dict(zip(code.co_freevars, target.get_match_index.__closure__, strict=True))
        seq = cells["seq"].cell_contents if "seq" in cells else None
        if isinstance(seq, list | tuple):
            return {"index": "prefix", "seq": [int(t) for t in seq]}
    return None


def undescribed(updates: Sequence[ResolvedPromptUpdate]) -> str | None:
    """Why these updates cannot travel as data (None: they can)."""
    for update in updates:
        if _describe_target(update.target) is None:
            kind = type(update.target).__name__
            return f"a {update.modality} update targets a {kind} no schema describes"
    return None


def encode_updates(updates: Sequence[ResolvedPromptUpdate]) -> bytes | None:
    """The updates as schema-1 JSON, or None when one cannot be described by data."""
    described: list[dict[str, Any]] = []
    for update in updates:
        target = _describe_target(update.target)
        if target is None:
            return None  # a closure of another kind: kept local
        content = update.content
        embed = None
        if content.is_embed is not None:
            embed = _embed_mask(content.is_embed, content.full)
        described.append(
            {
                "modality": update.modality,
                "item_idx": update.item_idx,
                "mode": UpdateMode(update.mode).value,
                "target": target,
                "full": [int(t) for t in content.full],
                "embed": embed,
            }
        )
    return json.dumps({"v": SCHEMA_VERSION, "updates": described}).encode()


# `is_embed(full)` of the last contents seen, by what alone decides it. An
# image's mask is computed in torch (0.02 ms hot, 0.2 ms on a cold cache,
# as between a busy API process's requests); images of one size have one.
# 64 entries: about 3 MB at most, of 1920x1080 images' (2,700 tokens each).
_MASKS: OrderedDict[tuple[object, ...], list[int]] = OrderedDict()
_MASKS_KEPT = 64
_MASKS_LOCK = threading.Lock()
_SCALARS = (int, bool, float, str, bytes, type(None))


def _embed_mask(is_embed: Any, full: list[int]) -> list[int]:
    """`is_embed(full)` as 0s and 1s, reused where it can depend on nothing but
    `full` (`_pure_key`); computed again otherwise."""
    pure = _pure_key(is_embed)
    if pure is None:
        return _mask_of(is_embed, full)
    key = (*pure, tuple(full))
    with _MASKS_LOCK:
        mask = _MASKS.get(key)
        if mask is not None:
            _MASKS.move_to_end(key)
            return list(mask)
    mask = _mask_of(is_embed, full)
    with _MASKS_LOCK:
        _MASKS[key] = mask
        while len(_MASKS) > _MASKS_KEPT:
            _MASKS.popitem(last=False)
    return list(mask)


def _mask_of(is_embed: Any, full: list[int]) -> list[int]:
    return [int(bool(x)) for x in is_embed(full).tolist()]


def _pure_key(is_embed: Any) -> tuple[object, ...] | None:
    """What decides a plain function's result besides its argument, where that
    is all: its code, its module's globals, and the values it captured, each
    an int, str, float, bool, bytes or None; no defaults; no global it reads
    but modules (vLLM's `select_token_id`: the token id, and torch). None for
    anything else (a list or a tensor captured, a callable object)."""
    code = getattr(is_embed, "__code__", None)
    if not isinstance(code, types.CodeType) or not isinstance(is_embed, types.FunctionType):
        return None
    if is_embed.__defaults__ or is_embed.__kwdefaults__:
        return None
    try:
        captured = tuple(cell.cell_contents for cell in is_embed.__closure__ or ())
    except ValueError:  # a cell not yet filled
        return None
    if any(type(value) not in _SCALARS for value in captured):
        return None
    names = is_embed.__globals__
    if any(
        name in names and not isinstance(names[name], types.ModuleType)
        for name in _names_read(code)
    ):
        return None
    return (code, id(names), captured)


def _names_read(code: types.CodeType) -> Iterator[str]:
    """The global (and attribute) names `code` and the code nested in it read."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names_read(const)


def decode_updates(blob: bytes) -> list[ResolvedPromptUpdate] | None:
    """The updates a schema-1 blob describes; None for anything else (process it then)."""
    decoded = _decoded(blob)
    return None if decoded is None else list(decoded)


@functools.lru_cache(maxsize=64)
def _decoded(blob: bytes) -> tuple[ResolvedPromptUpdate, ...] | None:
    """Images of one size share one blob (their tokens are the same), so a
    hit decodes it once. The updates are shared, as vLLM's own cache shares
    a stored item's between its hits (frozen; vLLM copies them to re-index).
    64 blobs: about 10 MB at most, of 1920x1080 images' (2,700 tokens each)."""
    try:
        document = json.loads(blob)
        if document.get("v") != SCHEMA_VERSION:
            return None
        return tuple(_decode_update(u) for u in document["updates"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


class _Mask:
    """`is_embed` for one content: the mask its owner computed."""

    __slots__ = ("_mask",)

    def __init__(self, mask: list[int]) -> None:
        self._mask = mask

    def __call__(self, full: list[int]) -> torch.Tensor:
        return torch.tensor(self._mask, dtype=torch.bool)


def _decode_update(u: dict[str, Any]) -> ResolvedPromptUpdate:
    full = [int(t) for t in u["full"]]
    embed = u["embed"]
    if embed is not None and len(embed) != len(full):
        raise ValueError("an embed mask must be as long as its content")
    target = u["target"]
    return ResolvedPromptUpdate(
        modality=str(u["modality"]),
        item_idx=int(u["item_idx"]),
        mode=UpdateMode(u["mode"]),
        target=(
            _index(str(target["index"]), tuple(int(t) for t in target.get("seq", ())))
            if isinstance(target, dict)
            else [int(t) for t in target]
        ),
        content=PromptUpdateDetails(full=full, is_embed=None if embed is None else _Mask(embed)),
    )


@functools.lru_cache(maxsize=1024)
def _index(kind: str, seq: tuple[int, ...]) -> PromptIndex:
    """One PromptIndex per description: vLLM groups updates by their index's
    identity, so equal descriptions share one, as the processor's did."""
    if kind == "start":
        return PromptIndexTargets.start()
    if kind == "end":
        return PromptIndexTargets.end()
    if kind == "prefix":
        return PromptIndexTargets.prefix(list(seq))
    raise ValueError(f"no index of kind {kind!r}")
