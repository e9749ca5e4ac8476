"""docs/vllm.md's CPU quick start (README shows the same block), run as
written: its shell block, with the tests' tiny Qwen2-VL in place of the hub's
model (no hub here) and free ports in place of 50052, 9471 and 8000. The real
`vllm serve` console script serves, the plugin is vLLM's cache, and the same
image sent twice with curl is a hit the second time."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from ..shell import run_block
from .conftest import free_port
from .tiny_model import REAL_PIXELS, build

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.engine,
    # The quick start builds and runs .venv-vllm: once, from that environment.
    pytest.mark.skipif(
        Path(sys.prefix).name != ".venv-vllm", reason="the quick start runs .venv-vllm"
    ),
]


def quick_start() -> str:
    text = (ROOT / "docs" / "vllm.md").read_text()
    marker = "<!-- run by tests/vllm/test_quickstart.py -->\n```sh\n"
    return text[text.index(marker) + len(marker) :].split("\n```\n", 1)[0]


def test_the_cpu_quick_start_works_as_written(tmp_path: Path) -> None:
    """The block, README's too, run to its end: two chats about one image,
    and the sidecar counts the second a hit."""
    model = build(tmp_path / "Qwen2-VL-tiny", REAL_PIXELS)  # 16384 positions: 4096 fit
    ports = {"50052": free_port(), "9471": free_port(), "8000": free_port()}
    script = re.sub(r"\b(50052|9471|8000)\b", lambda m: str(ports[m[1]]), quick_start())
    script = script.replace("Qwen/Qwen2-VL-2B-Instruct", str(model))
    code, said = run_block(
        script, tmp_path / "quickstart.log", {**os.environ, "VLLM_LOGGING_LEVEL": "INFO"}
    )
    assert code == 0, said[-4000:]
    assert said.count('"choices"') == 2, said[-4000:]
    assert "1 hits of 2 queries" in said, said[-4000:]
    assert said.count("mmcache: the multimodal processor cache is the sidecar at") == 2
