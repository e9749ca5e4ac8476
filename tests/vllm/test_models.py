"""The model matrix on a real engine (issue 29): four kinds of processor and
prompt update, each built tiny and offline, behind `--api-server-count 4`:

- Qwen2-VL, an image: its image pad token replaced by the image's tokens;
- Qwen2-VL, a video (MP4): another processor, its video pad token replaced;
- PaliGemma: the image tokens inserted at a position, not at a token
  (`PromptIndexTargets.prefix([bos])`), SigLIP tower, Gemma;
- LLaVA: its `<image>` placeholder token replaced (CLIP tower, Llama).

For each, a replay whose repeats land on other API processes: every repeat is
a hit in vLLM's own counters, the sidecar counts exactly what vLLM counts, the
greedy tokens are vLLM alone's; then a sidecar killed (SIGKILL) while
requests are in flight, and restarted while more go on, fails none of them."""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from . import tiny_paligemma
from .conftest import Sidecar
from .matrix import MATRIX
from .serve import metrics
from .serve import sidecar_metrics as settled
from .test_caches import eventually
from .test_ec import chat
from .test_engine import offline, serving

COLORS = ("red", "red", "blue", "red", "blue", "green", "red", "blue", "green", "red")
API_SERVERS = 4

# Each test starts a vLLM engine (left out where vLLM has no CPU build).
pytestmark = pytest.mark.engine


@pytest.fixture(scope="module", params=sorted(MATRIX))
def tiny(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, str]:
    entry = MATRIX[request.param]
    name = request.param.split()[0]
    return entry.build(tmp_path_factory.mktemp("model") / f"tiny-{name}"), entry.kind


def test_every_repeat_is_a_hit_across_api_servers_and_a_sidecar_restart_fails_nothing(
    tiny: tuple[Path, str], sidecar: Sidecar
) -> None:
    model, kind = tiny
    alone = offline(model, kind)["tokens"]  # red, red, blue, red: vLLM alone
    assert isinstance(alone, list) and alone[0] != alone[2]  # the image matters
    expected = {"red": alone[0], "blue": alone[2]}

    def replay(colors: tuple[str, ...]) -> None:
        for color in colors:
            status, tokens = chat(vllm_serve.port, color, kind)
            assert status == 200, color
            if color in expected:
                assert tokens == expected[color], color

    with serving(model, sidecar, "--api-server-count", str(API_SERVERS), kind=kind) as vllm_serve:
        # The OS spreads connections over the API processes: the replay goes on
        # (three times at most) until several have served, so repeats crossed them.
        sent: list[str] = []
        for _ in range(3):
            replay(COLORS)
            sent += COLORS
            if len(vllm_serve.processes_that_served()) >= 3:
                break
        assert len(vllm_serve.processes_that_served()) >= 2
        seen = metrics(f"http://127.0.0.1:{vllm_serve.port}/metrics")
        repeats = len(sent) - len(set(sent))
        counted = (seen["vllm:mm_cache_queries_total"], seen["vllm:mm_cache_hits_total"])
        assert counted == (len(sent), repeats)
        sidecar_metrics = f"http://127.0.0.1:{sidecar.metrics_port}/metrics"

        def sidecar_counted() -> tuple[float, float]:
            served = metrics(sidecar_metrics)
            return served["mmcache_queries_total"], served["mmcache_hits_total"]

        # The sidecar counts as vLLM counts, every query and every hit, once
        # the last request's report (sent in the background) is in.
        with contextlib.suppress(AssertionError):
            eventually(lambda: sidecar_counted() == counted)
        assert sidecar_counted() == counted
        # The engine gives its leases back in its report ring (docs/shm.md).
        eventually(lambda: metrics(sidecar_metrics)["mmcache_leases"] == 0, timeout=2)

        # Killed while requests are in flight, four at a time, then back on
        # its port while they go on: none fails, every answer is vLLM alone's.
        colors = ("red", "blue") * 6
        with ThreadPoolExecutor(4) as pool:
            answers = [pool.submit(chat, vllm_serve.port, c, kind) for c in colors]
            answers[1].result()
            sidecar.kill()
            answers[5].result()
            sidecar.start()
            got = [answer.result() for answer in answers]
        assert got == [(200, expected[c]) for c in colors]


def test_paligemma_on_two_data_parallel_engines_hits_every_repeat(sidecar: Sidecar) -> None:
    """The issue's case: `--data-parallel-size 2` with a model whose updates
    go at a position got 13 of 16 possible hits; every repeat is one now."""
    import tempfile

    model = tiny_paligemma.build(Path(tempfile.mkdtemp(prefix="tiny-paligemma-")))
    with serving(model, sidecar, "--data-parallel-size", "2") as vllm_serve:
        colors = COLORS[:6]
        assert [chat(vllm_serve.port, c)[0] for c in colors] == [200] * len(colors)
        seen = metrics(f"http://127.0.0.1:{vllm_serve.port}/metrics")
        repeats = len(colors) - len(set(colors))
        assert (seen["vllm:mm_cache_queries_total"], seen["vllm:mm_cache_hits_total"]) == (
            len(colors),
            repeats,
        )
    served = settled(sidecar.metrics_port)
    assert (served["mmcache_queries_total"], served["mmcache_hits_total"]) == (
        len(colors),
        repeats,
    )
    assert served["mmcache_leases"] == 0
