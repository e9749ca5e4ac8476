"""One model served from two paths names its items alike (client/vllm/_naming.py):
vLLM's item digests name the model by its processing files' content, not its path."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from vllm.config import ModelConfig
from vllm.multimodal import MULTIMODAL_REGISTRY

from mmcache.client.vllm._naming import (
    PROCESSING_FILES,
    model_identity,
    name_models_by_content,
)

from .tiny_model import build


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("model") / "tiny-qwen2-vl")


def model_id(path: Path) -> str:
    """What vLLM's processor digests an item's model as."""
    processor = MULTIMODAL_REGISTRY.create_processor(ModelConfig(model=str(path)))
    return str(processor.info.model_id)


def test_two_copies_of_a_model_name_items_alike_and_a_changed_processor_does_not(
    model: Path, tmp_path: Path
) -> None:
    copy = Path(shutil.copytree(model, tmp_path / "elsewhere"))
    name_models_by_content()
    name_models_by_content()  # once is enough; twice changes nothing
    assert model_id(model) == model_id(copy) == model_identity(str(model))
    assert model_id(model).startswith("files:")

    # The processor's settings change what an item is: another name.
    changed = Path(shutil.copytree(model, tmp_path / "changed"))
    present = [name for name in PROCESSING_FILES if (changed / name).is_file()]
    assert "config.json" in present and "tokenizer.json" in present
    settings = json.loads((changed / "processor_config.json").read_text())
    settings["image_processor"]["size"]["longest_edge"] //= 2
    (changed / "processor_config.json").write_text(json.dumps(settings))
    assert model_id(changed) != model_id(model)
    # Weights are not read: what names an item is what shapes it.
    assert model_identity("Qwen/Qwen2-VL-2B-Instruct") == "Qwen/Qwen2-VL-2B-Instruct"
