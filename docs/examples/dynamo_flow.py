"""A Dynamo-style flow with mmcache: the frontend processes, the worker gets hashes.

    python docs/examples/dynamo_flow.py MODEL_DIR SIDECAR   # e.g. 127.0.0.1:50051

1. Frontend: run the model's HF processor on each image, as vLLM's items;
   upload them with `get_and_update` (leased until the worker reads them);
   pass the worker the hashes (and, inline, any item whose `held` is False).
2. Worker: `fetch` the held items from its sidecar (one call, releasing the
   leases) and turn them back into vLLM's items.
3. Worker: hand them to vLLM's `inject_into_mm_cache`, so vLLM counts them
   as it counts its own processing (`vllm:mm_cache_queries`).

Prints one JSON line: what each side saw. Hashes are the frontend's own
(content digests): the worker never recomputes them.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
from typing import Any

from mmcache.client import MMCacheClient
from mmcache.client.vllm.convert import from_vllm, to_vllm


def process(model_dir: str, colors: list[str]) -> tuple[list[str], list[Any]]:
    """The frontend's processor: HF's, with vLLM's field layout for Qwen2-VL."""
    from PIL import Image
    from transformers import AutoProcessor
    from vllm.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargsItems

    processor = AutoProcessor.from_pretrained(model_dir)
    hashes, items = [], []
    for color in colors:
        image = Image.new("RGB", (100, 80), color)
        out = processor.image_processor(images=[image], return_tensors="pt")
        sizes = out["image_grid_thw"].prod(-1)
        fields = {
            "pixel_values": MultiModalFieldConfig.flat_from_sizes("image", sizes),
            "image_grid_thw": MultiModalFieldConfig.batched("image"),
        }
        items.append(MultiModalKwargsItems.from_hf_inputs(out, fields)["image"][0])
        hashes.append(hashlib.sha256(image.tobytes()).hexdigest())
    return hashes, items


async def frontend(target: str, hashes: list[str], items: list[Any]) -> list[bool]:
    async with MMCacheClient(target) as client:
        sent = await client.get_and_update([from_vllm(i, "image") for i in items], hashes)
        return sent.held  # where False: send that item inline instead


async def worker_read(target: str, hashes: list[str]) -> list[Any]:
    async with MMCacheClient(target, follow=False) as client:
        return [to_vllm(item) for item in await client.fetch(hashes)]


def green_data_url() -> str:
    import base64
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (100, 80), "green").save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def main(model_dir: str, target: str) -> None:
    from vllm import LLM

    hashes, items = process(model_dir, ["red", "blue"])
    held = asyncio.run(frontend(target, hashes, items))
    fetched = asyncio.run(worker_read(target, [h for h, k in zip(hashes, held, strict=True) if k]))
    llm = LLM(model=model_dir, enforce_eager=True, max_model_len=256, dtype="bfloat16",
              disable_log_stats=False, max_num_seqs=4, max_num_batched_tokens=256,
              limit_mm_per_prompt={"image": 1})  # fmt: skip
    llm.llm_engine.input_processor.inject_into_mm_cache({"image": hashes}, {"image": fetched})
    # The worker now runs requests; vLLM publishes its cache counters with the
    # engine's next step. One of a new image: one more query, a miss.
    image = {"type": "image_url", "image_url": {"url": green_data_url()}}
    message = {"role": "user", "content": [image, {"type": "text", "text": "Describe it."}]}
    llm.chat([message], use_tqdm=False)
    counters = {m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:mm_cache")}
    same = all(f == i for f, i in zip(fetched, items, strict=True))
    print(json.dumps({"held": held, "fetched_equal": same, "vllm": counters}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
