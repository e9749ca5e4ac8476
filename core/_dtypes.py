"""Element sizes of the tensor dtypes mmcache carries, by torch's name.

The server stores tensors as opaque bytes and needs no torch; this table is
how it checks that a declared dtype and shape agree with the bytes sent.
"""

from __future__ import annotations

from collections.abc import Iterable

from ._errors import InvalidArgumentError

__all__ = ["ITEMSIZE", "nbytes_of"]

# Every dtype a multimodal processor can emit, named as `str(torch.dtype)`
# without the "torch." prefix.
ITEMSIZE: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "uint16": 2,
    "int16": 2,
    "uint32": 4,
    "int32": 4,
    "uint64": 8,
    "int64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex32": 4,
    "complex64": 8,
    "complex128": 16,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
}

# Refuse shapes whose byte count could not be allocated anywhere, before any
# multiplication can reach absurd sizes.
_MAX_TENSOR_BYTES = 1 << 48


def nbytes_of(dtype: str, shape: Iterable[int]) -> int:
    """Bytes of a contiguous tensor of `dtype` and `shape`, validating both."""
    itemsize = ITEMSIZE.get(dtype)
    if itemsize is None:
        known = ", ".join(sorted(ITEMSIZE))
        raise InvalidArgumentError(f"unknown dtype {dtype!r}; known dtypes: {known}")
    n = itemsize
    span = itemsize  # as n, but a zero dimension does not empty it: torch's strides
    for dim in shape:
        if dim < 0:
            raise InvalidArgumentError(f"negative dimension {dim} in a shape of {dtype}")
        n *= dim
        span *= max(dim, 1)
        if span > _MAX_TENSOR_BYTES:
            raise InvalidArgumentError(
                f"a {dtype} tensor of that shape spans more than 2**48 bytes (even when a "
                "zero dimension empties it, its strides would overflow)"
            )
    return n
