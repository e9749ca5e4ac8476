"""What the tiny PaliGemma and LLaVA share: a word-level BPE tokenizer trained
on a few sentences, and random weights saved as vLLM 0.32 loads them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

SEED = 0  # fixed weights: the same greedy tokens every run


def train_bpe(special: list[str], sentence: str, unk: str | None = None) -> Any:
    """A `tokenizers` BPE of about 300 tokens, `special` ones first."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE(unk_token=unk))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    bpe.train_from_iterator(
        [sentence] * 50,
        trainers.BpeTrainer(vocab_size=300, special_tokens=special, show_progress=False),
    )
    return bpe


def save_model(model_class: Any, config: Any, directory: Path) -> None:
    """Random weights of `model_class` for `config`, seeded, in `directory`."""
    import torch

    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        model = model_class(config)
    model.save_pretrained(directory)
    _name_the_vision_tower_as_vllm_loads_it(directory / "model.safetensors")


def _name_the_vision_tower_as_vllm_loads_it(weights: Path) -> None:
    """transformers 5 saves a CLIP or SigLIP tower as `vision_tower.<part>`;
    vLLM 0.32 loads `vision_tower.vision_model.<part>` (and no pooling head)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(weights)
    renamed = {}
    for name, tensor in tensors.items():
        if name.startswith("vision_tower.head."):
            continue
        if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
            name = "vision_tower.vision_model." + name.removeprefix("vision_tower.")
        renamed[name] = tensor
    save_file(renamed, weights, metadata={"format": "pt"})
