"""Which identifiers name an item by its content, so that the fleet may share
it: those vLLM's own hasher made in this process, of the configured
algorithm's length. A request's `multi_modal_uuids` (the client's word for
what the item is) become the identifier where no processor setting is
hashed with them; two clients may give one uuid to two images, and NVIDIA
Dynamo's worker gives vLLM 64-bit uuids padded with zeros. Such an item is
kept in its process's own cache, as vLLM alone keeps it, and never reaches
the sidecar (issue 43).
"""

from __future__ import annotations

import functools
import string
import threading
from collections import OrderedDict
from typing import Any

__all__ = ["DIGEST_HEX", "Shape", "input_shape", "is_digest", "record_digests"]

# Hex digits of a full digest, by vLLM's --mm-hasher-algorithm.
DIGEST_HEX = {"blake3": 64, "sha256": 64, "sha512": 128}
_REMEMBERED = 65536  # digests made here, newest kept: far more than in flight
# What an image digest was made of: (width, height, the other settings
# hashed with it); None for anything else (video, embeddings, ...).
Shape = tuple[int, int, str]
_made: OrderedDict[str, Shape | None] = OrderedDict()
_lock = threading.Lock()
_HEX = frozenset(string.hexdigits.lower())


def record_digests() -> None:
    """Remember every identifier vLLM's hasher makes in this process (idempotent)."""
    from vllm.multimodal.hasher import MultiModalHasher

    hash_kwargs = MultiModalHasher.hash_kwargs
    if getattr(hash_kwargs, "_mmcache", False):
        return

    @functools.wraps(hash_kwargs)
    def recorded(*args: Any, **kwargs: Any) -> str:
        digest: str = hash_kwargs(*args, **kwargs)
        if any(isinstance(v, str) for k, v in kwargs.items() if k != "model_id"):
            return digest  # a client's uuid, hashed with processor settings: its word still
        shape = _shape(kwargs)
        with _lock:
            _made[digest] = shape
            _made.move_to_end(digest)
            if len(_made) > _REMEMBERED:
                _made.popitem(last=False)
        return digest

    recorded._mmcache = True  # type: ignore[attr-defined]
    MultiModalHasher.hash_kwargs = staticmethod(recorded)


def _shape(kwargs: dict[str, Any]) -> Shape | None:
    """The dimensions of the one image hashed, and the settings hashed with it
    (the processor's per-request options, which may change what it makes)."""
    from PIL import Image

    images = [
        name
        for name, value in kwargs.items()
        # vLLM's MediaWithBytes, or the image itself
        if isinstance(getattr(value, "media", value), Image.Image)
    ]
    if len(images) != 1:
        return None
    width, height = getattr(kwargs[images[0]], "media", kwargs[images[0]]).size  # its header's
    settings = ",".join(
        f"{name}={value!r}"[:200]
        for name, value in sorted(kwargs.items())
        if name not in ("model_id", images[0])
    )
    return width, height, settings


def input_shape(identifier: str) -> Shape | None:
    """What vLLM's hasher made `identifier` of here: an image's dimensions and
    settings; None for other media, or a digest not made (or no longer
    remembered) here."""
    with _lock:
        return _made.get(identifier)


def is_digest(identifier: str, algorithm: str) -> bool:
    """Whether `identifier` is a full digest of `algorithm` that vLLM's hasher
    made here: only such items are looked up in, and uploaded to, the sidecar."""
    if len(identifier) != DIGEST_HEX.get(algorithm, 64) or not _HEX.issuperset(identifier):
        return False
    with _lock:
        return identifier in _made
