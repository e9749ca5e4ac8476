"""Items for the tests: shaped like a vision processor's output."""

from __future__ import annotations

import torch

from mmcache import BatchedField, FieldElem, FlatField, MMItem


def image_item(seed: int, numel: int = 256, modality: str = "image") -> MMItem:
    """pixel_values (flat, float32) and image_grid_thw (batched, int64)."""
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randn(numel, generator=gen)
    grid = torch.tensor([1, seed % 7 + 1, 3], dtype=torch.int64)
    return MMItem.from_elems(
        [
            FieldElem(modality, "pixel_values", pixels, FlatField([slice(0, numel)], dim=0)),
            FieldElem(modality, "image_grid_thw", grid, BatchedField()),
        ]
    )
