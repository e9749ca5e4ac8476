"""A tiny LLaVA with random weights, built offline in seconds.

    python -m tests.vllm.tiny_llava DIR

The LLaVA family's shape: a CLIP vision tower (one layer, 28x28 images, 4
image tokens once the class token is dropped), a projector, and a 2-layer
Llama of hidden size 64 (2 heads of 32); `<image>` is a placeholder token that
vLLM replaces with the image's tokens (a token-sequence target).
"""

from __future__ import annotations

import sys
from pathlib import Path

from .tiny_parts import save_model, train_bpe

CHAT_TEMPLATE = (
    "{% for message in messages %}USER: {% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}<image>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def build(directory: Path) -> Path:
    """Write the model to `directory` (once) and return it."""
    if (directory / "config.json").exists():
        return directory
    from transformers import (
        CLIPImageProcessor,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        PreTrainedTokenizerFast,
    )

    directory.mkdir(parents=True, exist_ok=True)
    special = ["<unk>", "<s>", "</s>", "<image>"]
    bpe = train_bpe(
        special, "USER: What is in this image? ASSISTANT: A red square, a blue circle.", "<unk>"
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="<unk>", additional_special_tokens=["<image>"],
    )  # fmt: skip
    tokenizer.chat_template = CHAT_TEMPLATE
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in special}
    config = LlavaConfig(
        vision_config={
            "model_type": "clip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 28,
            "patch_size": 14,
            "projection_dim": 32,
        },
        text_config={
            "model_type": "llama",
            "vocab_size": len(tokenizer),
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 512,
            "initializer_range": 0.5,
            "bos_token_id": ids["<s>"],
            "eos_token_id": ids["</s>"],
            "pad_token_id": ids["<unk>"],
        },
        image_token_index=ids["<image>"],
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        torch_dtype="bfloat16",
    )
    save_model(LlavaForConditionalGeneration, config, directory)
    images = CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    processor = LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )
    processor.chat_template = CHAT_TEMPLATE
    processor.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
