"""More models on a real engine, beside the Qwen2-VL of test_engine.py: a
tiny PaliGemma, whose image tokens go at a position
(`PromptIndexTargets.prefix([bos])`), and a tiny LLaVA, whose `<image>`
placeholder token is replaced (CLIP tower, Llama). With `--api-server-count 2`
every repeat of an image is a hit in vLLM's own counters, whichever API
process processed it first, and the greedy tokens are those of vLLM alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from . import tiny_llava, tiny_paligemma
from .conftest import Sidecar
from .serve import metrics
from .test_ec import chat
from .test_engine import offline, serving

COLORS = ("red", "red", "blue", "red", "blue", "green", "red", "blue", "green", "red")
BUILDERS = {"paligemma": tiny_paligemma.build, "llava": tiny_llava.build}

# Each test starts a vLLM engine (left out where vLLM has no CPU build).
pytestmark = pytest.mark.engine


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    name: str = request.param
    return BUILDERS[name](tmp_path_factory.mktemp("model") / f"tiny-{name}")


def test_every_repeat_is_a_hit_across_api_servers(tiny: Path, sidecar: Sidecar) -> None:
    alone = offline(tiny)["tokens"]  # red, red, blue, red: vLLM alone
    assert isinstance(alone, list) and alone[0] != alone[2]  # the image matters
    expected = {"red": alone[0], "blue": alone[2]}
    with serving(tiny, sidecar, "--api-server-count", "2") as vllm_serve:
        # The OS spreads connections over the API processes: the replay goes on
        # (three times at most) until both have served, so repeats crossed them.
        sent: list[str] = []
        for _ in range(3):
            for color in COLORS:
                status, tokens = chat(vllm_serve.port, color)
                assert status == 200
                if color in expected:
                    assert tokens == expected[color], color
            sent += COLORS
            if len(vllm_serve.processes_that_served()) == 2:
                break
        assert len(vllm_serve.processes_that_served()) == 2
        seen = metrics(f"http://127.0.0.1:{vllm_serve.port}/metrics")
        repeats = len(sent) - len(set(sent))
        assert (seen["vllm:mm_cache_queries_total"], seen["vllm:mm_cache_hits_total"]) == (
            len(sent),
            repeats,
        )
    served = metrics(f"http://127.0.0.1:{sidecar.metrics_port}/metrics")
    assert served["mmcache_hits_total"] == repeats
    assert served["mmcache_leases"] == 0


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
    served = metrics(f"http://127.0.0.1:{sidecar.metrics_port}/metrics")
    assert served["mmcache_leases"] == 0
