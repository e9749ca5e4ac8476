"""Real NVIDIA Dynamo 1.6.1 on loopback: a `dynamo.vllm` worker and a
`dynamo.frontend` with vLLM's processor, file discovery, no etcd or NATS
(the environment: scripts/dynamo-env.sh)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.vllm.conftest import free_port
from tests.vllm.images import chat_messages

ROOT = Path(__file__).resolve().parents[2]
LOOPBACK = {
    name: "127.0.0.1"
    for name in (
        "DYN_TCP_RPC_HOST",
        "DYN_TCP_RESPONSE_STREAM_HOST",
        "DYN_EVENT_PLANE_HOST",
        "DYN_SYSTEM_HOST",
    )
}


@dataclass
class Answer:
    status: int
    prompt_tokens: int
    text: str
    seconds: float


@dataclass
class Frontend:
    port: int

    def chat(self, color: str, timeout: float = 120, image_url: str | None = None) -> Answer:
        """A chat about a `color` image (or the image at `image_url`)."""
        messages = chat_messages(color)
        if image_url is not None:
            messages[0]["content"][0]["image_url"]["url"] = image_url
        body = {"model": "tiny", "max_tokens": 8, "temperature": 0, "messages": messages}
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/chat/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        started = time.monotonic()
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                answer: dict[str, Any] = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return Answer(exc.code, 0, "", time.monotonic() - started)
        return Answer(
            200,
            int(answer["usage"]["prompt_tokens"]),
            str(answer["choices"][0]["message"]["content"]),
            time.monotonic() - started,
        )


class Stack:
    """Workers and frontends sharing one discovery directory."""

    def __init__(self, model: Path, work: Path) -> None:
        self.model = model
        self.work = work
        self.env = {
            **os.environ,
            **LOOPBACK,
            "DYN_DISCOVERY_BACKEND": "file",
            "DYN_FILE_KV": str(work / "discovery"),
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_LOGGING_LEVEL": "WARNING",
            "PYTHONPATH": str(ROOT),
        }
        self.env.pop("MMCACHE_TARGET", None)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []

    def _start(self, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        log = self.work / f"{name}-{len(self.logs)}.log"
        self.logs.append(log)
        with log.open("wb") as sink:
            proc = subprocess.Popen(
                [sys.executable, "-m", *args],
                cwd=ROOT,
                env={**self.env, **env},
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
        self.procs.append(proc)
        return proc

    def worker(self, mmcache: str | None, max_model_len: int = 256) -> None:
        """A vLLM worker (its own sidecar at `mmcache`, or none); returns once
        it registered its endpoint."""
        env: dict[str, str] = {}
        if mmcache is not None:
            env["MMCACHE_TARGET"] = mmcache
        proc = self._start(
            "worker",
            [
                *("dynamo.vllm", "--model", str(self.model), "--served-model-name", "tiny"),
                *("--enable-multimodal", "--enforce-eager", "--max-model-len", str(max_model_len)),
                *("--max-num-seqs", "4", "--max-num-batched-tokens", str(max_model_len)),
                *("--limit-mm-per-prompt", '{"image": 1}', "--dtype", "bfloat16"),
            ],
            env,
        )
        self._wait(proc, self.logs[-1], "Registered endpoint", 300)

    def frontend(self, mmcache: str | None, **more: str) -> Frontend:
        """A frontend with vLLM's processor (and `more` in its environment);
        returns once it serves the model."""
        port = free_port()
        env = {**more} if mmcache is None else {"MMCACHE_TARGET": mmcache, **more}
        proc = self._start(
            "frontend",
            [
                *("dynamo.frontend", "--dyn-chat-processor", "vllm"),
                *("--http-host", "127.0.0.1", "--http-port", str(port)),
            ],
            env,
        )
        frontend = Frontend(port)
        deadline = time.monotonic() + 240
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
                    if b'"tiny"' in r.read():
                        return frontend
            except (urllib.error.URLError, OSError):
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the frontend did not start: {self.tail()}")
            time.sleep(1)

    def _wait(self, proc: subprocess.Popen[bytes], log: Path, line: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while line not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the worker did not start: {self.tail()}")
            time.sleep(1)

    def cards(self) -> list[dict[str, Any]]:
        """The model cards the workers registered (file discovery's records)."""
        found = []
        for path in (self.work / "discovery").rglob("*"):
            if path.is_file() and "/mdc/" in str(path):
                record = json.loads(path.read_text())
                found.append(record.get("card_json", record))
        return found

    def tail(self) -> str:
        return "\n".join(
            f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}" for log in self.logs
        )

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.procs = []


@contextmanager
def stack(model: Path) -> Iterator[Stack]:
    with tempfile.TemporaryDirectory(prefix="dynamo-") as work:
        running = Stack(model, Path(work))
        try:
            yield running
        finally:
            running.stop()
