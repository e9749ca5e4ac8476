"""The item model: what vLLM calls a `MultiModalKwargsItem`.

An item maps each key ("pixel_values", "image_grid_thw", ...) to a field
element: the data, how the field batches (batched, flat or shared) and the
modality. The data is a tensor, lists or tuples of them nested to any depth,
or a plain int, float or bool. Nothing here imports torch, so the server can
share these names without it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias, Union

if TYPE_CHECKING:
    import torch

__all__ = [
    "BatchedField",
    "Field",
    "FieldElem",
    "FlatField",
    "Item",
    "MMItem",
    "NestedData",
    "SharedField",
]

# A tensor, a plain scalar, or lists/tuples of them nested to any depth.
NestedData: TypeAlias = Union["torch.Tensor", int, float, bool, list[Any], tuple[Any, ...]]


@dataclass(frozen=True)
class BatchedField:
    """Each item is one element along the batch dimension."""

    keep_on_cpu: bool = False  # vLLM: left on the CPU, not moved to the accelerator


@dataclass(frozen=True)
class FlatField:
    """Items are slices of one concatenated tensor along `dim`."""

    slices: Sequence[slice] | Sequence[Sequence[slice]] = field(default_factory=tuple)
    dim: int = 0
    keep_on_cpu: bool = False

    def __post_init__(self) -> None:
        # A list and a tuple of the same slices are the same field.
        # Anything else is left as given, for the codec to reject by name.
        if isinstance(self.slices, list | tuple):
            slices = tuple(tuple(s) if isinstance(s, list | tuple) else s for s in self.slices)
            object.__setattr__(self, "slices", slices)


@dataclass(frozen=True)
class SharedField:
    """Every item of a batch of `batch_size` shares the same data."""

    batch_size: int = 1
    keep_on_cpu: bool = False


Field: TypeAlias = BatchedField | FlatField | SharedField


@dataclass
class FieldElem:
    """One key of an item: its data, field kind and modality."""

    modality: str
    key: str
    data: NestedData
    field: Field

    def __eq__(self, other: object) -> bool:
        # Tensors compare elementwise; equality here means the same key,
        # modality and field, and bit-identical data (mmcache._equal).
        if not isinstance(other, FieldElem):
            return NotImplemented
        from mmcache._equal import nested_equal

        return (
            self.modality == other.modality
            and self.key == other.key
            and self.field == other.field
            and nested_equal(self.data, other.data)
        )

    __hash__ = None  # type: ignore[assignment]


class MMItem(dict[str, FieldElem]):
    """An item: key -> FieldElem, like vLLM's `MultiModalKwargsItem`."""

    @classmethod
    def from_elems(cls, elems: Sequence[FieldElem]) -> MMItem:
        return cls({elem.key: elem for elem in elems})

    @property
    def modality(self) -> str:
        """The item's modality (every field of an item shares it)."""
        modalities = {elem.modality for elem in self.values()}
        if len(modalities) != 1:
            raise ValueError(f"an item has exactly one modality; this one has {sorted(modalities)}")
        return modalities.pop()


# What the client accepts and returns: an MMItem, or a plain mapping
# {key: tensor-or-nested} (vLLM's caches accept that form too).
Item: TypeAlias = MMItem | Mapping[str, NestedData]
