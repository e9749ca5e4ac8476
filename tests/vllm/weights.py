"""The tiny models' weights as vLLM 0.32 loads them."""

from __future__ import annotations

from pathlib import Path


def name_the_vision_tower_as_vllm_loads_it(weights: Path) -> None:
    """transformers 5 saves a CLIP or SigLIP tower as `vision_tower.<part>`;
    vLLM 0.32 loads `vision_tower.vision_model.<part>` (and no pooling head)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(weights)
    renamed = {}
    for name, tensor in tensors.items():
        if name.startswith("vision_tower.head."):
            continue
        if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
            name = "vision_tower.vision_model." + name.removeprefix("vision_tower.")
        renamed[name] = tensor
    save_file(renamed, weights, metadata={"format": "pt"})
