"""vLLM's own cache hits on each model of the matrix, alone and with mmcache.

    .venv-vllm/bin/python -m bench.models [--requests 40] [--api-servers 4]

Runs in the vLLM environment (`make bench` does). Each model of
tests/vllm/matrix.py (tiny, random weights, built offline: a Qwen2-VL sent
images and videos, a PaliGemma, a LLaVA) is served with `vllm serve
--api-server-count 4`, first alone and then with the plugin and a fresh
sidecar, and sent the same requests, four at a time: one image (or video)
each, drawn from 8 colours with a few coming back often. Printed per model:
vLLM's hits of its queries alone (each API process has a cache of its own)
and with mmcache (one cache for all), and the sidecar's own counts beside
vLLM's. Requests for an item already seen but still in flight elsewhere are
misses either way: the table shows what such traffic gets, not a bound.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench import stop_on_sigterm
from tests.vllm.conftest import Sidecar, free_port
from tests.vllm.matrix import MATRIX
from tests.vllm.serve import metrics, serve_command, wait_healthy
from tests.vllm.test_ec import chat

ROOT = Path(__file__).resolve().parent.parent
COLORS = ("red", "blue", "green", "yellow", "purple", "orange", "white", "black")


def requests(count: int, seed: int) -> list[str]:
    """`count` colours, the first few far more often than the rest (Zipf-like)."""
    rng = random.Random(seed)
    weights = [1 / (rank + 1) ** 1.1 for rank in range(len(COLORS))]
    return rng.choices(COLORS, weights, k=count)


def run(
    model: Path, kind: str, api_servers: int, sent: list[str], sidecar: Sidecar | None
) -> tuple[dict[str, float], dict[str, float]]:
    """vLLM's counters (and the sidecar's) after `sent`, four at a time."""
    port = free_port()
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    if sidecar is not None:
        env["MMCACHE_TARGET"] = sidecar.target
    options = ("--limit-mm-per-prompt", f'{{"{kind}": 1}}', "--api-server-count", str(api_servers))
    proc = subprocess.Popen(
        serve_command(str(model), port, *options),
        cwd=ROOT,
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_healthy(port, proc, timeout=300)
        with ThreadPoolExecutor(4) as pool:
            statuses = list(pool.map(lambda color: chat(port, color, kind)[0], sent))
        if statuses != [200] * len(sent):
            raise RuntimeError(f"requests failed: {sorted(set(statuses))}")
        time.sleep(0.5)  # the last uploads and reports, sent in the background
        served = (
            {} if sidecar is None else metrics(f"http://127.0.0.1:{sidecar.metrics_port}/metrics")
        )
        return metrics(f"http://127.0.0.1:{port}/metrics"), served
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--api-servers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    stop_on_sigterm()  # the deployments stop with the bench
    sent = requests(args.requests, args.seed)
    repeats = len(sent) - len(set(sent))
    print(
        f"\nThe model matrix: `vllm serve --api-server-count {args.api_servers}`, "
        f"{len(sent)} requests of one item each, {len(set(sent))} distinct "
        f"({repeats} repeats), four at a time; vLLM's hits of its queries, and the "
        "sidecar's counts beside vLLM's"
    )
    print(
        "| model | item | prompt update | vLLM alone: hits | with mmcache: hits "
        "| sidecar: queries / hits |"
    )
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, entry in MATRIX.items():
            model = entry.build(Path(tmp) / name.replace(" ", "-"))
            alone, _ = run(model, entry.kind, args.api_servers, sent, None)
            sidecar = Sidecar(capacity_gb=1)
            sidecar.start()
            try:
                cached, served = run(model, entry.kind, args.api_servers, sent, sidecar)
            finally:
                sidecar.stop()

            def hits(seen: dict[str, float]) -> str:
                queries = seen["vllm:mm_cache_queries_total"]
                return f"{seen['vllm:mm_cache_hits_total']:.0f} of {queries:.0f}"

            print(
                f"| {name.split()[0]} | {entry.kind} | {entry.update} | {hits(alone)} "
                f"| {hits(cached)} | {served['mmcache_queries_total']:.0f} / "
                f"{served['mmcache_hits_total']:.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
