"""Validation and size of an item's wire description (`mmcache.v1.ItemSpec`).

`item_size` is the one size function of mmcache: the client charges its
mirror with it and the server charges its store with it, both from the same
spec, so the two agree byte for byte. Size = the bytes of every tensor leaf
plus `sys.getsizeof` of every scalar leaf, as vLLM counts an item.
"""

from __future__ import annotations

import string
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from mmcache.v1 import cache_pb2 as pb

from ._dtypes import nbytes_of
from ._errors import InvalidArgumentError

__all__ = [
    "MAX_DEPTH",
    "MAX_FEED_GAP_S",
    "MAX_HASHES_PER_CALL",
    "MAX_METADATA_BYTES",
    "MAX_MODALITIES_PER_REPORT",
    "MAX_NAMESPACE_CHARS",
    "MAX_NAME_CHARS",
    "NAMESPACE_CHARS",
    "NAMESPACE_KEY",
    "NAMESPACE_SEP",
    "SpecSize",
    "check_count",
    "check_counts",
    "check_name",
    "check_namespace",
    "item_size",
    "store_key",
]

MAX_DEPTH = 32  # nesting of lists/tuples in one field's data
MAX_NAME_CHARS = 256  # keys, modalities and hashes
# A call names its namespace in this metadata entry (e.g. model@processor
# version); none or empty is the default namespace.
NAMESPACE_KEY = "mmcache-namespace"
NAMESPACE_SEP = "\0"  # between a namespace and a hash in a store key
MAX_NAMESPACE_CHARS = 128
# Hashes (entries, touches) one call may carry: a request's items are a few
# hundred at most; this keeps one call's bookkeeping and reply small.
MAX_HASHES_PER_CALL = 16384
# The longest gap between feed messages a subscriber may ask (Subscribe's
# gap_ms): a mirror further behind than this loses too many lookups' worth.
MAX_FEED_GAP_S = 5.0
# Modalities one report of client-answered misses may name (Release.misses):
# a deployment has a handful; the bound keeps the metrics' labels few.
MAX_MODALITIES_PER_REPORT = 16
NAMESPACE_CHARS = frozenset(string.ascii_letters + string.digits + "._-:/@+=")
# An item's opaque metadata blob (vLLM's prompt updates, by a schema of the
# caller's): stored with the item and charged in its size.
MAX_METADATA_BYTES = 64 << 10


@dataclass(frozen=True, slots=True)
class SpecSize:
    payload: int  # tensor bytes that travel as chunks
    charged: int  # what the LRU charges: payload + getsizeof of scalar leaves
    leaves: int  # tensor leaves, in payload order


def check_name(what: str, value: str, *, allow_empty: bool = False) -> None:
    """Reject empty (unless allowed) or overlong identifiers with a clear message."""
    if not value and not allow_empty:
        raise InvalidArgumentError(f"{what} must not be empty")
    if len(value) > MAX_NAME_CHARS:
        raise InvalidArgumentError(
            f"{what} is {len(value)} characters long; the limit is {MAX_NAME_CHARS}"
        )
    if "\x00" in value:  # the server's separator of namespace and hash
        raise InvalidArgumentError(f"{what} {value[:64]!r} contains a NUL character")
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: protobuf strings are UTF-8
            raise InvalidArgumentError(f"{what} {value[:64]!r} is not valid UTF-8") from None


def check_counts(what: str, counts: Mapping[str, int]) -> None:
    """A report's counts by modality (`misses`, `hits`): few modalities, each a valid name."""
    if len(counts) > MAX_MODALITIES_PER_REPORT:
        raise InvalidArgumentError(
            f"the report counts {what} of {len(counts)} modalities; the limit is "
            f"{MAX_MODALITIES_PER_REPORT}: report the rest as modality '' (unknown)"
        )
    for modality in counts:
        check_name("modality", modality, allow_empty=True)


def check_count(what: str, count: int) -> None:
    """Reject a call carrying more than MAX_HASHES_PER_CALL hashes in one list."""
    if count > MAX_HASHES_PER_CALL:
        raise InvalidArgumentError(
            f"the call carries {count} {what}; the limit is {MAX_HASHES_PER_CALL} per call: "
            "split it into several calls"
        )


def store_key(namespace: str, mm_hash: str) -> str:
    """The store's key of a hash in a namespace: "N\\0hash", or the bare hash in
    the default one (hashes hold no NUL, so no key of one spells another's)."""
    return f"{namespace}{NAMESPACE_SEP}{mm_hash}" if namespace else mm_hash


def check_namespace(value: str) -> None:
    """A namespace is empty (the default) or up to MAX_NAMESPACE_CHARS of NAMESPACE_CHARS."""
    if len(value) > MAX_NAMESPACE_CHARS:
        raise InvalidArgumentError(
            f"namespace is {len(value)} characters long; the limit is {MAX_NAMESPACE_CHARS}"
        )
    bad = sorted(set(value) - NAMESPACE_CHARS)
    if bad:
        raise InvalidArgumentError(
            f"namespace {value[:64]!r} has {''.join(bad)!r}: use letters, digits "
            "and . _ - : / @ + ="
        )


def item_size(spec: pb.ItemSpec) -> SpecSize:
    """Validate `spec` and return its payload and charged sizes.

    Raises InvalidArgumentError naming the field at fault.
    """
    if spec.form not in (pb.ItemSpec.FORM_ITEM, pb.ItemSpec.FORM_MAPPING):
        raise InvalidArgumentError(f"item form must be FORM_ITEM or FORM_MAPPING, got {spec.form}")
    payload = 0
    scalars = 0
    leaves = 0
    seen: set[str] = set()
    for elem in spec.fields:
        check_name("field key", elem.key)
        if elem.key in seen:
            raise InvalidArgumentError(f"field key {elem.key!r} appears twice")
        seen.add(elem.key)
        check_name(f"modality of field {elem.key!r}", elem.modality, allow_empty=True)
        if spec.form == pb.ItemSpec.FORM_ITEM and elem.WhichOneof("field") is None:
            raise InvalidArgumentError(f"field {elem.key!r} has no field kind")
        stack: list[tuple[pb.Node, int]] = [(elem.data, 0)]
        while stack:
            node, depth = stack.pop()
            kind = node.WhichOneof("kind")
            if kind == "tensor":
                payload += nbytes_of(node.tensor.dtype, node.tensor.shape)
                leaves += 1
            elif kind == "int_value":
                scalars += sys.getsizeof(int(node.int_value))
            elif kind == "float_value":
                scalars += sys.getsizeof(float(node.float_value))
            elif kind == "bool_value":
                scalars += sys.getsizeof(bool(node.bool_value))
            elif kind in ("list", "tuple"):
                if depth >= MAX_DEPTH:
                    raise InvalidArgumentError(
                        f"field {elem.key!r} nests deeper than {MAX_DEPTH} levels"
                    )
                children = node.list.items if kind == "list" else node.tuple.items
                stack.extend((child, depth + 1) for child in children)
            else:
                raise InvalidArgumentError(f"field {elem.key!r} has a data node with no value")
    return SpecSize(payload=payload, charged=payload + scalars, leaves=leaves)
