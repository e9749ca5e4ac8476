"""One offline vLLM engine, four chats (red, red, blue, red): their greedy
tokens and vLLM's cache counters, as one JSON line `RESULT {...}`.

    python -m tests.vllm.offline MODEL [image|video]
"""

from __future__ import annotations

import json
import sys

from .images import chat_messages

if __name__ == "__main__":
    from vllm import LLM, SamplingParams

    kind = sys.argv[2] if len(sys.argv) > 2 else "image"

    llm = LLM(
        model=sys.argv[1],
        enforce_eager=True,
        max_model_len=256,
        dtype="bfloat16",
        disable_log_stats=False,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        limit_mm_per_prompt={kind: 1},
    )
    greedy = SamplingParams(temperature=0, max_tokens=8)
    tokens = [
        list(llm.chat(chat_messages(color, kind), greedy, use_tqdm=False)[0].outputs[0].token_ids)
        for color in ("red", "red", "blue", "red")
    ]
    metrics = {m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:mm_cache")}
    print("RESULT", json.dumps({"tokens": tokens, "metrics": metrics}), flush=True)
