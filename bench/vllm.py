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

Then the EC connector (`mmcache.client.vllm_ec`): two engines, separate `vllm
serve` processes, take the same chats' requests in turn (a router with no
image affinity). Once with no connector, once with one sidecar per engine
(each keeps its own outputs: no sharing), once with one sidecar shared by
both. Printed: vision-encoder runs (the connector's `mmcache_ec_encoded`,
which tests/vllm/test_ec.py checks against the vision tower's own calls; vLLM
alone counts none), runs avoided (outputs loaded instead), the bytes loaded,
request latency p50/p99, and an image's bytes as pixel_values and as an
encoder output.
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


def ec_config(sidecar: Sidecar) -> str:
    return json.dumps(
        {
            "ec_connector": "CountingECConnector",
            "ec_connector_module_path": "tests.vllm.counting_ec",
            "ec_role": "ec_both",
            "ec_connector_extra_config": {"target": sidecar.target},
        }
    )


@dataclass
class Fleet:
    encoded: float | None
    loaded: float
    loaded_bytes: float
    latencies: list[float]


def replay_fleet(
    model: Path, chats: list[list[list[str]]], sidecars: list[Sidecar] | None
) -> Fleet:
    """Two engines taking turns: turn i of a chat goes to engine i % 2."""
    ports = [free_port(), free_port()]
    procs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, port in enumerate(ports):
            options = ["--limit-mm-per-prompt", '{"image": 4}']
            env = {"MMCACHE_TEST_ENCODER_CALLS": f"{tmp}/calls{i}"}
            if sidecars is not None:
                options += ["--ec-transfer-config", ec_config(sidecars[i])]
            procs.append(
                subprocess.Popen(
                    serve_command(str(model), port, *options),
                    cwd=ROOT,
                    env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **env},
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        try:
            for port, proc in zip(ports, procs, strict=True):
                wait_healthy(port, proc, timeout=300)

            def conversation(turns: list[list[str]]) -> list[float]:
                return [chat(ports[i % 2], colors) for i, colors in enumerate(turns)]

            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                latencies = [t for ts in pool.map(conversation, chats) for t in ts]
            time.sleep(2)  # vLLM publishes its stats a step after the work
            seen = [metrics(f"http://127.0.0.1:{port}/metrics") for port in ports]
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(60)

    def total(name: str) -> float:
        return sum(m.get(f"mmcache_ec_{name}_total", 0.0) for m in seen)

    encoded = total("encoded") if sidecars is not None else None
    return Fleet(encoded, total("loaded"), total("loaded_bytes"), latencies)


def item_bytes(model: Path) -> tuple[int, int]:
    """One test image's bytes as pixel_values (float32, as the processor makes
    them) and as the encoder's output (tokens x hidden size, bfloat16)."""
    from PIL import Image
    from transformers import AutoConfig, AutoProcessor

    processor = AutoProcessor.from_pretrained(model).image_processor
    out = processor(images=[Image.new("RGB", (100, 80), "red")], return_tensors="pt")
    pixels = out["pixel_values"]
    merge = AutoConfig.from_pretrained(model).vision_config.spatial_merge_size
    tokens = int(out["image_grid_thw"].prod()) // merge**2
    hidden = AutoConfig.from_pretrained(model).text_config.hidden_size
    return pixels.numel() * pixels.element_size(), tokens * hidden * 2


def ec_table(model: Path, chats: list[list[list[str]]]) -> None:
    pixel_bytes, output_bytes = item_bytes(model)
    print(
        f"\nEC connector, 2 engines taking turns; an image is {pixel_bytes / 1024:.1f} KiB "
        f"as pixel_values, {output_bytes / 1024:.1f} KiB as an encoder output"
    )
    print(
        "| cache of encoder outputs | encoder runs | runs avoided (loaded) | KiB loaded "
        "| latency p50 / p99 ms |"
    )
    print("|---|---|---|---|---|")
    for name in ("vLLM alone", "one sidecar per engine", "one shared sidecar"):
        sidecars = None
        if name != "vLLM alone":
            shared = Sidecar()
            sidecars = [shared, shared] if name == "one shared sidecar" else [shared, Sidecar()]
        for sidecar in set(sidecars or ()):
            sidecar.start()
        try:
            run = replay_fleet(model, chats, sidecars)
        finally:
            for sidecar in set(sidecars or ()):
                sidecar.stop()
        cuts = statistics.quantiles(run.latencies, n=100, method="inclusive")
        encoded = "not counted" if run.encoded is None else f"{run.encoded:.0f}"
        print(
            f"| {name} | {encoded} | {run.loaded:.0f} | {run.loaded_bytes / 1024:.1f} "
            f"| {cuts[49] * 1e3:.0f} / {cuts[98] * 1e3:.0f} |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--api-servers", default="1,2,4")
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", choices=("plugin", "ec"), help="one table only")
    args = parser.parse_args()
    chats = trace(args.conversations, args.seed)
    requests = sum(len(t) for t in chats)
    refs = sum(len(colors) for t in chats for colors in t)
    with tempfile.TemporaryDirectory() as tmp:
        model = build(Path(tmp) / "tiny-qwen2-vl")
        if args.only == "ec":
            ec_table(model, chats)
            return
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
        if args.only is None:
            ec_table(model, chats)


if __name__ == "__main__":
    main()
