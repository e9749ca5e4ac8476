"""One offline vLLM engine on the issue-42 trace: a small image first (a
readiness probe's), then 448x448 photos that come back; greedy tokens and
vLLM's cache counters, as one JSON line `RESULT {...}`.

    python -m tests.vllm.offline_trace MODEL
"""

from __future__ import annotations

import base64
import json
import sys
from typing import Any

from bench.photos import jpeg

# The probe (64x64), then three photos in the order a chat re-sends them.
TRACE = [(64, 0), (448, 1), (448, 2), (448, 1), (448, 3), (448, 2), (448, 1), (448, 3)]


def messages(side: int, seed: int) -> list[dict[str, Any]]:
    url = "data:image/jpeg;base64," + base64.b64encode(jpeg(side, side, seed=seed)).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "?"}]
    return [{"role": "user", "content": content}]


if __name__ == "__main__":
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=sys.argv[1],
        enforce_eager=True,
        max_model_len=1024,
        dtype="bfloat16",
        disable_log_stats=False,
        max_num_seqs=4,
        max_num_batched_tokens=1024,
        limit_mm_per_prompt={"image": 1},
    )
    greedy = SamplingParams(temperature=0, max_tokens=4)
    tokens = [
        list(llm.chat(messages(side, seed), greedy, use_tqdm=False)[0].outputs[0].token_ids)
        for side, seed in TRACE
    ]
    metrics = {m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:mm_cache")}
    print("RESULT", json.dumps({"tokens": tokens, "metrics": metrics}), flush=True)
