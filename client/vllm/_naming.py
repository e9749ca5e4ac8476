"""Items named alike wherever one model is served from: by its files' content.

vLLM names a processed item with a digest that covers `model_config.model`,
the path the model was loaded from (`BaseProcessingInfo.model_id`). One
model served from two paths (two mount points, two nodes' caches, NVIDIA
Dynamo's frontend, which loads copies of the model's files from its own
cache) then names one image two ways, and its processes never share an item.

With the plugin active, `model_id` is the model's identity instead: for a
local directory, a digest of the files that shape processed items
(PROCESSING_FILES: the processors' settings, the architecture, the
tokenizer), and for anything else (a hub id) the name as before. Two
checkpoints of one architecture with the same processor share processed
items, which are the same tensors; their encoder outputs differ, and the EC
connector's scope keeps the path and the weights' config for that.
`model_id` serves nothing but these digests in vLLM 0.31 to 0.33.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any

__all__ = ["PROCESSING_FILES", "model_identity", "name_models_by_content"]

# Dynamo's frontend reads copies of exactly these (its model card's files).
PROCESSING_FILES = (
    "config.json",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
)


@functools.lru_cache(maxsize=8)
def model_identity(model: str) -> str:
    """A local model directory by the content of its PROCESSING_FILES (a file
    absent counts as such); anything else by its name."""
    directory = Path(model)
    if not directory.is_dir():
        return model
    digest = hashlib.sha256()
    for name in PROCESSING_FILES:
        path = directory / name
        digest.update(name.encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest() if path.is_file() else b"-")
    return f"files:{digest.hexdigest()}"


def name_models_by_content() -> None:
    """vLLM's item digests name the model by model_identity (idempotent)."""
    from vllm.multimodal.processing.context import BaseProcessingInfo

    named = BaseProcessingInfo.model_id
    if getattr(named.fget, "_mmcache", False):
        return

    def model_id(self: Any) -> str:
        return model_identity(str(named.fget(self)))

    model_id._mmcache = True  # type: ignore[attr-defined]
    BaseProcessingInfo.model_id = property(model_id)
