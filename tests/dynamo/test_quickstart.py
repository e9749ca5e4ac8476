"""docs/dynamo.md's quick start on one machine, run as written: its shell
block, with the tests' tiny Qwen2-VL in place of the hub's model (no hub
here), and free ports and a fresh discovery directory in place of the
doc's. Real Dynamo processes serve, the image is processed once, and the
repeat is a hit in the sidecar."""

from __future__ import annotations

import os
import re
from pathlib import Path

from tests.shell import run_block
from tests.vllm.conftest import free_port
from tests.vllm.tiny_model import REAL_PIXELS, build

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- run by tests/dynamo/test_quickstart.py -->\n```sh\n"


def quick_start() -> str:
    text = (ROOT / "docs" / "dynamo.md").read_text()
    return text[text.index(MARKER) + len(MARKER) :].split("\n```\n", 1)[0]


def test_the_dynamo_quick_start_works_as_written(tmp_path: Path) -> None:
    # A name with "Qwen" in it: the block waits for /v1/models to list one.
    model = build(tmp_path / "Qwen2-VL-tiny", REAL_PIXELS)
    ports = {"50053": free_port(), "9472": free_port(), "8001": free_port()}
    script = re.sub(r"\b(50053|9472|8001)\b", lambda m: str(ports[m[1]]), quick_start())
    script = script.replace("Qwen/Qwen2-VL-2B-Instruct", str(model))
    script = script.replace("/tmp/dynamo-quickstart", str(tmp_path / "discovery"))
    code, said = run_block(
        script, tmp_path / "quickstart.log", {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"}
    )
    assert code == 0, said[-4000:]
    assert said.count('"choices"') == 2, said[-4000:]
    assert "1 hits of 2 queries" in said, said[-4000:]
