"""`vllm serve` as the tests and bench/vllm.py run it, and reading /metrics."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.error
import urllib.request

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


def metrics(url: str) -> dict[str, float]:
    """Every sample at `url`, summed over labels, by name."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums
