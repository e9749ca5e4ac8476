"""An item's wire description (`ItemSpec`): made from an item, and read back
into one, with the tensors left to the caller (the codec, which has torch).

The spec's structure (keys, field kinds, modalities, scalars, nesting) is
written and read here alone; a tensor leaf is its dtype's name and shape.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, SupportsIndex, TypeVar

from google.protobuf import json_format
from google.protobuf.message import DecodeError

from mmcache._dtypes import nbytes_of
from mmcache._errors import InvalidArgumentError
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
from mmcache._spec import MAX_DEPTH, SpecSize, check_name, item_size
from mmcache.v1 import cache_pb2 as pb

__all__ = ["Leaf", "Spec", "TensorLeaf", "describe", "parse_spec"]

_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1

Tensor = TypeVar("Tensor")

# What the codec says of a data value: its (dtype name, shape) when it is a
# tensor (which it keeps), None when it is not one.
Leaf = Callable[[str, object], tuple[str, Sequence[int]] | None]


@dataclass(frozen=True, slots=True)
class TensorLeaf:
    """One tensor of an item, in payload order (depth first, fields in order)."""

    key: str  # its field's
    path: str  # where it sits: the key, then list indices ("pixel_values[0]")
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


class Spec:
    """An item's spec as the client holds it: read by the methods below, sent
    and received by the wire layer alone."""

    __slots__ = ("_leaves", "_size", "message")

    def __init__(self, message: pb.ItemSpec) -> None:
        self.message = message  # the wire's; for the wire layer and its tests
        self._size: SpecSize | None = None
        self._leaves: tuple[TensorLeaf, ...] | None = None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Spec) and other.message == self.message

    __hash__ = None  # type: ignore[assignment]

    @property
    def size(self) -> SpecSize:
        """What both sides charge for the item; checks the spec
        (InvalidArgumentError for one that is not valid)."""
        if self._size is None:
            self._size = item_size(self.message)
        return self._size

    @property
    def is_item(self) -> bool:
        """An MMItem's (fields with kinds and modalities), not a plain mapping's."""
        return self.message.form == pb.ItemSpec.FORM_ITEM

    @property
    def modality(self) -> str:
        """Its first field's modality, as the server labels a lookup's hit."""
        fields = self.message.fields
        return fields[0].modality if fields else ""

    def byte_size(self) -> int:
        return self.message.ByteSize()

    def serialize(self) -> bytes:
        return self.message.SerializeToString()

    def as_dict(self) -> dict[str, Any]:
        """The spec as JSON would show it (`mmcache get`)."""
        return json_format.MessageToDict(self.message)

    def leaves(self) -> tuple[TensorLeaf, ...]:
        """Each tensor leaf, in payload order."""
        if self._leaves is None:
            found: list[TensorLeaf] = []
            for elem in self.message.fields:
                _walk_tensors(elem.key, elem.key, elem.data, found)
            self._leaves = tuple(found)
        return self._leaves

    def flat_fields(self) -> tuple[tuple[str, str, Field], ...] | None:
        """(key, modality, field) per field of an MMItem whose every field's
        data is one tensor: the item is then built with no walk of the spec."""
        fields = self.message.fields
        if not self.is_item or any(e.data.WhichOneof("kind") != "tensor" for e in fields):
            return None
        return tuple((e.key, e.modality, _decode_field(e)) for e in fields)

    def assemble(
        self, tensors: Iterator[Tensor], shaped: Callable[[Tensor, TensorLeaf], Any]
    ) -> Item:
        """The item in the form it was stored, taking its tensors (raw, in
        payload order) from `tensors`, each given its dtype and shape by
        `shaped`."""
        leaves = iter(self.leaves())

        def tensor() -> Any:
            return shaped(next(tensors), next(leaves))

        if self.is_item:
            return MMItem(
                {
                    elem.key: FieldElem(
                        elem.modality, elem.key, _build(elem.data, tensor), _decode_field(elem)
                    )
                    for elem in self.message.fields
                }
            )
        return {elem.key: _build(elem.data, tensor) for elem in self.message.fields}


def parse_spec(raw: bytes) -> Spec:
    """A serialised spec (as the region's extents hold them)."""
    try:
        return Spec(pb.ItemSpec.FromString(raw))
    except DecodeError:
        raise InvalidArgumentError("an item spec that does not parse") from None


def describe(item: Item, leaf: Leaf) -> tuple[Spec, str]:
    """`item`'s spec, and the modality its fields share ("" if none or several).

    An `MMItem` (or any mapping whose values are all `FieldElem`s) keeps its
    field kinds and modalities (FORM_ITEM); any other mapping is stored as
    plain {key: data} (FORM_MAPPING). `leaf` is asked of every data value
    that is no scalar or list/tuple. Raises InvalidArgumentError naming the
    key at fault for data the wire cannot carry.
    """
    if not isinstance(item, Mapping):
        raise InvalidArgumentError(
            f"an item is a mapping of key -> data or an MMItem, not {type(item).__name__}"
        )
    as_item = isinstance(item, MMItem) or (
        bool(item) and all(isinstance(v, FieldElem) for v in item.values())
    )
    spec = pb.ItemSpec(form=pb.ItemSpec.FORM_ITEM if as_item else pb.ItemSpec.FORM_MAPPING)
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
        _encode_node(key, data, elem.data, leaf, 0)
    return Spec(spec), modalities.pop() if len(modalities) == 1 else ""


# -- writing ------------------------------------------------------------------


def _encode_node(key: str, data: object, node: pb.Node, leaf: Leaf, depth: int) -> None:
    # A tensor first; then bool before int: True is an int to isinstance.
    tensor = None if isinstance(data, bool | int | float | list | tuple) else leaf(key, data)
    if tensor is not None:
        node.tensor.dtype, shape = tensor
        node.tensor.shape.extend(shape)
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
            _encode_node(key, child, container.items.add(), leaf, depth + 1)
    else:
        raise InvalidArgumentError(
            f"field {key!r} holds a {type(data).__module__}.{type(data).__qualname__}; "
            "item data must be tensors, ints, floats, bools, or lists/tuples of them"
        )


def _int64(key: str, value: object, what: str) -> int:
    # A plain int first: the protocol check is slow, and this runs per field.
    if type(value) is not int and (isinstance(value, bool) or not isinstance(value, SupportsIndex)):
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


# -- reading ------------------------------------------------------------------


def _walk_tensors(key: str, path: str, node: pb.Node, found: list[TensorLeaf]) -> None:
    kind = node.WhichOneof("kind")
    if kind == "tensor":
        shape = tuple(node.tensor.shape)
        found.append(
            TensorLeaf(key, path, node.tensor.dtype, shape, nbytes_of(node.tensor.dtype, shape))
        )
    elif kind in ("list", "tuple"):
        for index, child in enumerate(node.list.items if kind == "list" else node.tuple.items):
            _walk_tensors(key, f"{path}[{index}]", child, found)


def _build(node: pb.Node, tensor: Callable[[], Any]) -> NestedData:
    """The data under `node`, its tensors taken in payload order."""
    kind = node.WhichOneof("kind")
    if kind == "tensor":
        built: NestedData = tensor()
        return built
    if kind == "int_value":
        return int(node.int_value)
    if kind == "float_value":
        return float(node.float_value)
    if kind == "bool_value":
        return bool(node.bool_value)
    if kind == "list":
        return [_build(child, tensor) for child in node.list.items]
    # item_size has checked that every node has a kind.
    return tuple(_build(child, tensor) for child in node.tuple.items)


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
