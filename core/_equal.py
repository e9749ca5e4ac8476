"""Bit-exact equality of nested item data (tensors, scalars, lists, tuples).

A cache must hand back exactly what it was given, so equality here is by
bits: NaNs with the same payload are equal, 0.0 and -0.0 are not, a list is
never equal to a tuple and True is never equal to 1. Torch is imported only
once a tensor is seen: the server imports the core without it.
"""

from __future__ import annotations

import struct
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["nested_equal"]


def nested_equal(a: object, b: object) -> bool:
    """Whether `a` and `b` are the same nested data, bit for bit.

    Tensors must agree in dtype, shape and bytes (not in strides or device):

        nested_equal([t, 1.5], [t.clone(), 1.5])  # True
        nested_equal((t,), [t])  # False: a tuple is not a list
    """
    kind = _kind(a)
    if kind != _kind(b):
        return False
    if kind == "tensor":
        return _tensors_equal(a, b)  # type: ignore[arg-type]
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):  # same kind: checked above
        return len(a) == len(b) and all(nested_equal(x, y) for x, y in zip(a, b, strict=True))
    if kind == "float":
        # By bits: a NaN equals itself, and -0.0 is not 0.0.
        return struct.pack("<d", a) == struct.pack("<d", b)
    if kind in ("bool", "int"):
        return a == b
    return type(a) is type(b) and bool(a == b)


def _kind(x: object) -> str | None:
    # bool before int: True is an int to isinstance.
    if isinstance(x, bool):
        return "bool"
    if isinstance(x, int):
        return "int"
    if isinstance(x, float):
        return "float"
    if isinstance(x, list):
        return "list"
    if isinstance(x, tuple):
        return "tuple"
    # A tensor can only exist once torch has been imported by someone.
    torch_module = sys.modules.get("torch")
    if torch_module is not None and isinstance(x, torch_module.Tensor):
        return "tensor"
    return None


def _tensors_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    import torch

    return torch.equal(_raw_bytes(a), _raw_bytes(b))


def _raw_bytes(t: torch.Tensor) -> torch.Tensor:
    import torch

    t = t.detach().cpu().resolve_conj().resolve_neg()
    if t.is_complex():
        t = torch.view_as_real(t)  # same bytes; a complex32 copy would warn "experimental"
    t = t.contiguous()
    # By strides: a contiguous tensor may keep any stride on a dimension of
    # size 0 or 1, which reshape keeps and .view refuses.
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8)
