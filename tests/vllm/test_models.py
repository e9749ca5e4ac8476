"""More than one model on a real engine: a tiny PaliGemma, whose image tokens
go at a position (`PromptIndexTargets.prefix([bos])`) rather than at a
placeholder token. With `--api-server-count 2` every repeat of an image is a
hit in vLLM's own counters, whichever API process processed it first, and the
greedy tokens are those of vLLM alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import Sidecar
from .images import chat_messages
from .serve import metrics, post_chat
from .test_engine import offline, serving
from .tiny_paligemma import build

COLORS = ("red", "red", "blue", "red", "blue", "green", "red", "blue", "green", "red")


@pytest.fixture(scope="module")
def paligemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("model") / "tiny-paligemma")


def chat(port: int, color: str) -> tuple[int, list[int]]:
    body = {
        "model": "",
        "max_tokens": 8,
        "temperature": 0,
        "return_token_ids": True,
        "messages": chat_messages(color),
    }
    status, answer = post_chat(port, body)
    return status, [] if answer is None else list(answer["choices"][0]["token_ids"])


def test_paligemma_hits_every_repeat_across_api_servers(paligemma: Path, sidecar: Sidecar) -> None:
    alone = offline(paligemma)["tokens"]  # red, red, blue, red: vLLM alone
    assert isinstance(alone, list) and alone[0] != alone[2]  # the image matters
    expected = {"red": alone[0], "blue": alone[2]}
    with serving(paligemma, sidecar, "--api-server-count", "2") as vllm_serve:
        answers = [chat(vllm_serve.port, color) for color in COLORS]
        assert [status for status, _ in answers] == [200] * len(COLORS)
        for color, (_, tokens) in zip(COLORS, answers, strict=True):
            if color in expected:
                assert tokens == expected[color], color
        seen = metrics(f"http://127.0.0.1:{vllm_serve.port}/metrics")
        repeats = len(COLORS) - len(set(COLORS))
        assert (seen["vllm:mm_cache_queries_total"], seen["vllm:mm_cache_hits_total"]) == (
            len(COLORS),
            repeats,
        )
        assert len(vllm_serve.processes_that_served()) == 2  # repeats crossed processes
    served = metrics(f"http://127.0.0.1:{sidecar.metrics_port}/metrics")
    assert served["mmcache_hits_total"] == repeats
    assert served["mmcache_leases"] == 0
