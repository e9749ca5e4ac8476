"""The sidecar's keys for vLLM's items: vLLM's identifier in a key scope.

A scope is a digest of what shapes the stored data, so two models (or one
model in two dtypes, for encoder outputs) on one sidecar never share a key:
`scope_of` for processed items (the plugin's), `ec_scope_of` for encoder
outputs (the EC connector's). `scoped_key` is the one way a key is made.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from ._naming import model_identity

__all__ = ["ec_scope_of", "scope_of", "scoped_key"]


def scoped_key(scope: str, identifier: str) -> str:
    """The sidecar's key of vLLM's `identifier` (its mm_hash) in `scope`."""
    return f"{scope}:{identifier}"


def scope_of(vllm_config: Any, namespace: str | None = None) -> str:
    """The key scope of a model's processed items: a digest of what shapes
    them, and the namespace (default: MMCACHE_NAMESPACE)."""
    if namespace is None:
        from ._settings import Settings

        namespace = Settings.from_env().namespace
    model = vllm_config.model_config
    multimodal = model.get_multimodal_config()
    tokenizer = getattr(model, "tokenizer", None) or model.model
    return _digest(
        {
            "model": model_identity(str(model.model)),
            "revision": str(getattr(model, "revision", None)),
            "tokenizer": model_identity(str(tokenizer)),
            "mm_processor_kwargs": getattr(multimodal, "mm_processor_kwargs", None),
            # The digest vLLM names items with (blake3, sha256, sha512): keys
            # made under one are never read under another.
            "mm_hasher_algorithm": str(getattr(multimodal, "mm_hasher_algorithm", "blake3")),
            "hf_overrides": getattr(model, "hf_overrides", None),
            "namespace": namespace,
        }
    )


def ec_scope_of(vllm_config: Any, namespace: str | None = None) -> str:
    """The key scope of a model's encoder outputs: what shapes its items, plus
    the weights (revision, config, quantization), the dtype the encoder runs in
    and vLLM's version."""
    import vllm

    model = vllm_config.model_config
    hf_config = getattr(model, "hf_config", None)
    return _digest(
        {
            "kind": "encoder_output",
            "processed": scope_of(vllm_config, namespace),
            # Fine-tunes share processing files, not encoders: the path too.
            "model": str(model.model),
            "dtype": str(getattr(model, "dtype", None)),
            "quantization": str(getattr(model, "quantization", None)),
            "code_revision": str(getattr(model, "code_revision", None)),
            # Two checkpoints served from one path differ here at least.
            "hf_config": hf_config.to_json_string() if hf_config is not None else None,
            "vllm": vllm.__version__,  # encoders change between versions
        }
    )


def _digest(described: Mapping[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:16]
