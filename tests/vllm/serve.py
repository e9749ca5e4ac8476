"""`vllm serve` as the tests and bench/vllm.py run it, and reading /metrics."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families


def serve_command(model: str, port: int, *options: str) -> list[str]:
    """`vllm serve` of the tiny model on `port`, small enough for 2 cores."""
    return [
        *(sys.executable, "-m", "tests.vllm.launch", "serve", model, "--port", str(port)),
        *("--enforce-eager", "--max-model-len", "256", "--dtype", "bfloat16"),
        *("--max-num-seqs", "4", "--max-num-batched-tokens", "256", *options),
    ]


def wait_healthy(port: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Until vLLM answers /health; fails if it exits or takes longer than `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except (urllib.error.URLError, OSError):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("vllm serve did not start") from None
            time.sleep(1)


def metrics(url: str, **labels: str) -> dict[str, float]:
    """Every sample at `url` (those with `labels`, if given), summed over the
    other labels, by name."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if all(sample.labels.get(k) == v for k, v in labels.items()):
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums


def sidecar_metrics(port: int) -> dict[str, float]:
    """A sidecar's /metrics once what its clients wrote in their report rings
    is in: the sidecar reads the rings within 200 ms when no call makes it
    sooner (docs/shm.md), so a read's lease given back and its bytes show
    only then."""
    time.sleep(0.3)
    return metrics(f"http://127.0.0.1:{port}/metrics")


def post_chat(port: int, body: dict[str, Any], timeout: float = 120) -> tuple[int, Any]:
    """POST a chat completion: the HTTP status and the answer (None on an error)."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return int(response.status), json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return int(exc.code), None
