"""A tiny Qwen2-VL with random weights, built offline in seconds.

    python -m tests.vllm.tiny_model DIR

No hub access exists on our machines, so the tests make their own model: a
byte-level BPE tokenizer trained on a few sentences plus Qwen's special
tokens, a 2-layer text model of hidden size 64 (2 heads: vLLM's CPU
attention wants a head size of 32 or more), a vision tower of depth 1, an
image processor that keeps images small, and a Qwen-style chat template.
Greedy decoding of random weights is deterministic, which is all the tests
need: outputs with and without the cache must match token for token.
"""

from __future__ import annotations

import sys
from pathlib import Path

SEED = 0  # checked: red and blue give different greedy tokens with these weights

SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or part['type'] == 'video_url' %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# The image processor's pixel limits: the tests' (images stay a few tokens) and
# Qwen2-VL's own (a 1024x1024 image is 1369 tokens), which bench/vllm.py uses.
SMALL_PIXELS = (56 * 56, 112 * 112)
REAL_PIXELS = (56 * 56, 14 * 14 * 4 * 16384)


def build(directory: Path, pixels: tuple[int, int] = SMALL_PIXELS) -> Path:
    """Write the model to `directory` (once) and return it."""
    if (directory / "config.json").exists():
        return directory
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    directory.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    text = ["What is in this image? A red square, a blue circle, describe it."] * 50
    bpe.train_from_iterator(
        text, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL, show_progress=False)
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL[1:],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL}
    config = Qwen2VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 512 if pixels == SMALL_PIXELS else 16384,
            "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]},
            "tie_word_embeddings": True,
            "initializer_range": 0.5,  # outputs that depend on the image
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
        vision_config={
            "depth": 1,
            "embed_dim": 32,
            "hidden_size": 64,
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
            "initializer_range": 0.5,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        torch_dtype="bfloat16",
    )
    # Fixed weights: with an unseeded draw, red and blue now and then gave the
    # same greedy tokens, and the test that the image matters failed by chance.
    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        model = Qwen2VLForConditionalGeneration(config)
    model.save_pretrained(directory)
    images = Qwen2VLImageProcessor(min_pixels=pixels[0], max_pixels=pixels[1])
    videos = Qwen2VLVideoProcessor(min_pixels=pixels[0], max_pixels=pixels[1])
    processor = Qwen2VLProcessor(
        image_processor=images, tokenizer=tokenizer, video_processor=videos
    )
    processor.chat_template = CHAT_TEMPLATE
    processor.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
