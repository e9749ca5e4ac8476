"""docs/vllm.md's CPU quick start, run as written: its shell block, with the
tests' tiny Qwen2-VL in place of the hub's model (no hub here) and free ports
in place of 50051 and 8000. The real `vllm serve` console script serves, the
plugin is vLLM's cache, and a repeated image is a hit."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import free_port
from .images import chat_messages
from .serve import post_chat
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
    section = text[text.index("## Quick start on a CPU machine") :]
    block = re.search(r"^```sh\n(.*?)^```$", section, re.DOTALL | re.MULTILINE)
    assert block is not None
    return block.group(1)


def test_the_cpu_quick_start_works_as_written(tmp_path: Path) -> None:
    model = build(tmp_path / "tiny-qwen2-vl", REAL_PIXELS)  # 16384 positions: 4096 fit
    sidecar_port, vllm_port = free_port(), free_port()
    script = (
        quick_start()
        .replace("Qwen/Qwen2-VL-2B-Instruct", str(model))
        .replace("127.0.0.1:50051", f"127.0.0.1:{sidecar_port}")
        .replace("--capacity-gb 2 &", f"--capacity-gb 2 --port {sidecar_port} --metrics-port 0 &")
        .replace("--port 8000", f"--port {vllm_port}")
    )
    log = tmp_path / "quickstart.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            ["bash", "-c", f"set -e\n{script}\nwait"],
            cwd=ROOT,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # the script's children go with it
            env={**os.environ, "VLLM_LOGGING_LEVEL": "INFO"},
        )
    try:
        deadline = time.monotonic() + 300
        body = {"model": str(model), "max_tokens": 4, "temperature": 0,
                "messages": chat_messages("red")}  # fmt: skip
        while True:
            try:
                status, _ = post_chat(vllm_port, body, timeout=60)
                break
            except OSError:
                assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
                assert time.monotonic() < deadline, "vllm serve did not start"
                time.sleep(2)
        assert status == 200
        assert post_chat(vllm_port, body, timeout=60)[0] == 200  # the repeat: a hit
        stats = subprocess.run(
            [str(ROOT / ".venv-vllm" / "bin" / "mmcache"), "stats", f"127.0.0.1:{sidecar_port}"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip
        assert "1 hits of 2 queries" in stats, stats
        said = log.read_text(errors="replace")
        assert said.count("mmcache: the multimodal processor cache is the sidecar at") == 2
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
