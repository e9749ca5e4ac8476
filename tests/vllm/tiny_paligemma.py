"""A tiny PaliGemma with random weights, built offline in seconds.

    python -m tests.vllm.tiny_paligemma DIR

PaliGemma places its image tokens at a position (vLLM's
`PromptIndexTargets.prefix([bos])`), not at a placeholder token: the model
of the tests for prompt updates that travel as positions. A SigLIP vision
tower of one layer on 28x28 images (4 image tokens), a 2-layer Gemma of
hidden size 64 (2 heads of 32), a BPE tokenizer trained on a few sentences
with `<image>`, `<bos>`, `<eos>` and a newline token (vLLM appends one to
PaliGemma's prompts), and a chat template that keeps the text only (vLLM
inserts the image tokens itself).
"""

from __future__ import annotations

import sys
from pathlib import Path

from .tiny_parts import save_model, train_bpe

CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% endfor %}"
)


def build(directory: Path) -> Path:
    """Write the model to `directory` (once) and return it."""
    if (directory / "config.json").exists():
        return directory
    from transformers import (
        GemmaTokenizerFast,
        PaliGemmaConfig,
        PaliGemmaForConditionalGeneration,
        PaliGemmaProcessor,
        SiglipImageProcessor,
    )

    directory.mkdir(parents=True, exist_ok=True)
    special = ["<pad>", "<eos>", "<bos>", "<unk>", "<image>", "\n"]
    bpe = train_bpe(special, "What is in this image? A red square, a blue circle, describe it.")
    tokenizer = GemmaTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        add_bos_token=True,
        add_eos_token=False,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in special}
    config = PaliGemmaConfig(
        vision_config={
            "model_type": "siglip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 28,
            "patch_size": 14,
            "projection_dim": 64,
        },
        text_config={
            "model_type": "gemma",
            "vocab_size": len(tokenizer),
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "max_position_embeddings": 512,
            "initializer_range": 0.5,
            "bos_token_id": ids["<bos>"],
            "eos_token_id": ids["<eos>"],
            "pad_token_id": ids["<pad>"],
        },
        image_token_index=ids["<image>"],
        projection_dim=64,
        hidden_size=64,
        vocab_size=len(tokenizer),
        bos_token_id=ids["<bos>"],
        eos_token_id=ids["<eos>"],
        pad_token_id=ids["<pad>"],
        torch_dtype="bfloat16",
    )
    save_model(PaliGemmaForConditionalGeneration, config, directory)
    images = SiglipImageProcessor(size={"height": 28, "width": 28})
    images.image_seq_length = 4  # (28 / 14) ** 2 patches, one token each
    processor = PaliGemmaProcessor(image_processor=images, tokenizer=tokenizer)
    processor.chat_template = CHAT_TEMPLATE
    processor.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
