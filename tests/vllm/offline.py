"""One offline vLLM engine, its greedy tokens and vLLM's cache counters, as
one JSON line `RESULT {...}`:

- `image` or `video`: four chats (red, red, blue, red);
- `trace`: issue 42's trace: a 64x64 image first (a readiness probe's), then
  448x448 photos that come back (on the model with Qwen2-VL's real pixel
  limits: 256 tokens each).

    python -m tests.vllm.offline MODEL [image|video|trace]
"""

from __future__ import annotations

import base64
import json
import sys
from typing import Any

from bench.photos import jpeg

from .images import chat_messages

# The probe, then three photos in the order a chat re-sends them: (side, seed).
TRACE = [(64, 0), (448, 1), (448, 2), (448, 1), (448, 3), (448, 2), (448, 1), (448, 3)]


def photo_messages(side: int, seed: int) -> list[dict[str, Any]]:
    url = "data:image/jpeg;base64," + base64.b64encode(jpeg(side, side, seed=seed)).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "?"}]
    return [{"role": "user", "content": content}]


if __name__ == "__main__":
    from vllm import LLM, SamplingParams

    kind = sys.argv[2] if len(sys.argv) > 2 else "image"
    chats = (
        [photo_messages(side, seed) for side, seed in TRACE]
        if kind == "trace"
        else [chat_messages(color, kind) for color in ("red", "red", "blue", "red")]
    )
    room = 1024 if kind == "trace" else 256
    llm = LLM(
        model=sys.argv[1],
        enforce_eager=True,
        max_model_len=room,
        dtype="bfloat16",
        disable_log_stats=False,
        max_num_seqs=4,
        max_num_batched_tokens=room,
        limit_mm_per_prompt={"image" if kind == "trace" else kind: 1},
    )
    greedy = SamplingParams(temperature=0, max_tokens=8)
    tokens = [
        list(llm.chat(messages, greedy, use_tqdm=False)[0].outputs[0].token_ids)
        for messages in chats
    ]
    metrics = {m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:mm_cache")}
    print("RESULT", json.dumps({"tokens": tokens, "metrics": metrics}), flush=True)
