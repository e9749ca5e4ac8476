"""The model matrix: tiny models built offline, each a different processor and
kind of prompt update (tests/vllm/test_models.py; bench/models.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import tiny_llava, tiny_model, tiny_paligemma


@dataclass(frozen=True)
class Entry:
    build: Callable[[Path], Path]
    kind: str  # what its chats send: "image" or "video"
    update: str  # how vLLM puts the item's tokens into the prompt


MATRIX: dict[str, Entry] = {
    # (No pipes in these: they are cells of markdown tables.)
    "qwen2-vl image": Entry(tiny_model.build, "image", "its image pad token replaced"),
    "qwen2-vl video": Entry(
        tiny_model.build, "video", "its video pad token replaced (the video processor, MP4)"
    ),
    "paligemma": Entry(
        tiny_paligemma.build, "image", "inserted at a position (`PromptIndexTargets.prefix`)"
    ),
    "llava": Entry(tiny_llava.build, "image", "`<image>` replaced (CLIP, Llama)"),
}
