"""vLLM alone beside vLLM with mmcache: N API servers, multi-turn chats with images.

    .venv-vllm/bin/python -m bench.vllm [--api-servers 1,2,4] [--conversations 12]

Runs in the vLLM environment (scripts/vllm-env.sh; `make bench` does). A
tiny random-weight Qwen2-VL (built offline, as the tests build it) is served
by `vllm serve --api-server-count N`, once without and once with the plugin
(a fresh sidecar each time). The replay: `conversations` chats of 1-4 turns,
four at a time; every turn adds an image (colors from a Zipf-like pool of
8, all 100x80, so every item has the same size) and re-sends all earlier
images of the chat, as OpenAI-style chat APIs do.

Printed per N: vLLM's hit rate; the tensor bytes P0 shipped to P1 (a miss
ships its item; a hit ships nothing, except in vLLM alone with N > 1, where
vLLM falls back to per-process caches and ships every item; an item's size
is what the sidecar received per upload); the bytes the engine read from the
sidecar instead; processor runs avoided (hits) and the
processor time that saves (hits x one item's processing time, measured
here); request latency p50/p99.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import statistics
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tests.vllm.conftest import Sidecar, free_port
from tests.vllm.images import data_url
from tests.vllm.serve import metrics, serve_command, wait_healthy
from tests.vllm.tiny_model import build

COLORS = ["red", "blue", "green", "yellow", "purple", "orange", "white", "black"]
ROOT = Path(__file__).resolve().parent.parent


def trace(conversations: int, seed: int) -> list[list[list[str]]]:
    """Per conversation, per turn, the colors of its images so far."""
    rng = random.Random(seed)
    weights = [1 / (rank + 1) ** 1.1 for rank in range(len(COLORS))]
    chats = []
    for _ in range(conversations):
        images: list[str] = []
        turns = []
        for _ in range(rng.randint(1, 4)):
            color = rng.choices(COLORS, weights)[0]
            if color not in images:
                images.append(color)
            turns.append(list(images))
        chats.append(turns)
    return chats


def chat(port: int, colors: list[str]) -> float:
    content = [{"type": "image_url", "image_url": {"url": data_url(c)}} for c in colors]
    content.append({"type": "text", "text": "What is in these images?"})
    body = {"model": "", "max_tokens": 4, "temperature": 0, "messages": [
        {"role": "user", "content": content}]}  # fmt: skip
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as response:
        response.read()
    return time.perf_counter() - start


def start_vllm(
    model: Path, port: int, api_servers: int, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        serve_command(
            str(model),
            port,
            *("--limit-mm-per-prompt", '{"image": 4}', "--api-server-count", str(api_servers)),
        ),
        cwd=ROOT,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING", **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


@dataclass
class Run:
    queries: float
    hits: float
    latencies: list[float]
    sidecar_sent: float = 0.0
    sidecar_received: float = 0.0


def replay(
    model: Path, api_servers: int, chats: list[list[list[str]]], sidecar: Sidecar | None
) -> Run:
    port = free_port()
    env = {} if sidecar is None else {"MMCACHE_TARGET": sidecar.target}
    proc = start_vllm(model, port, api_servers, env)
    try:
        wait_healthy(port, proc, timeout=300)

        def conversation(turns: list[list[str]]) -> list[float]:
            return [chat(port, colors) for colors in turns]

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            latencies = [t for ts in pool.map(conversation, chats) for t in ts]
        seen = metrics(f"http://127.0.0.1:{port}/metrics")
        run = Run(seen["vllm:mm_cache_queries_total"], seen["vllm:mm_cache_hits_total"], latencies)
        if sidecar is not None:
            served = metrics(f"http://127.0.0.1:{sidecar.metrics_port}/metrics")
            run.sidecar_sent = served["mmcache_sent_bytes_total"]
            run.sidecar_received = served["mmcache_received_bytes_total"]
        return run
    finally:
        proc.terminate()
        proc.wait(60)


def processing_time(model: Path) -> float:
    """One image's time in the model's HF image processor."""
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model).image_processor
    image = Image.new("RGB", (100, 80), "red")
    processor(images=[image], return_tensors="pt")
    start = time.perf_counter()
    for _ in range(20):
        processor(images=[image], return_tensors="pt")
    return (time.perf_counter() - start) / 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--api-servers", default="1,2,4")
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    chats = trace(args.conversations, args.seed)
    requests = sum(len(t) for t in chats)
    refs = sum(len(colors) for t in chats for colors in t)
    with tempfile.TemporaryDirectory() as tmp:
        model = build(Path(tmp) / "tiny-qwen2-vl")
        seconds = processing_time(model)
        print(
            f"{args.conversations} chats, {requests} requests, {refs} images sent; one image "
            f"takes {seconds * 1e3:.1f} ms to process (a real model's processor takes far more)"
        )
        print(
            "| API servers | cache | hit rate | KiB P0 -> P1 | KiB sidecar -> engine "
            "| processor runs avoided | processor time avoided | latency p50 / p99 ms |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for n in (int(x) for x in args.api_servers.split(",")):
            alone = replay(model, n, chats, None)
            sidecar = Sidecar()
            sidecar.start()
            try:
                cached = replay(model, n, chats, sidecar)
            finally:
                sidecar.stop()
            # Every item has the same size: what the sidecar got per upload
            # (every miss of the mmcache run is uploaded once).
            nbytes = cached.sidecar_received / max(cached.queries - cached.hits, 1)
            for name, run, ships_hits in (("vLLM alone", alone, n > 1), ("mmcache", cached, False)):
                shipped = (run.queries if ships_hits else run.queries - run.hits) * nbytes
                cuts = statistics.quantiles(run.latencies, n=100, method="inclusive")
                print(
                    f"| {n} | {name} | {run.hits / run.queries:.2f} | {shipped / 1024:.0f} "
                    f"| {run.sidecar_sent / 1024:.0f} | {run.hits:.0f} "
                    f"| {run.hits * seconds * 1e3:.0f} ms "
                    f"| {cuts[49] * 1e3:.0f} / {cuts[98] * 1e3:.0f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
