"""A hit skips the image's decode: vLLM's media connector, decoding lazily.

vLLM names an image by a digest of its encoded bytes (`MediaWithBytes`: the
bytes as they came, plus the decode settings that changed them), not of its
pixels, so a repeat is known before anything is decoded. Yet its
`ImageMediaIO` decodes every image as it loads it, hits included: 4.6 ms of
CPU for a 1024x1024 JPEG here, 9.4 ms at 1920x1080, more than half of what
the processor itself costs. On a hit the pixels are never used: the
processor is skipped and the engine reads the item from the sidecar.

`MMCacheMediaConnector` is vLLM's own connector (same fetching, same limits,
same errors) whose images are opened but not decoded where decoding would
change nothing but the timing: no EXIF rotation to apply and already in the
mode asked for (a colour JPEG in RGB). PIL decodes such an image the first
time its pixels are read, which on a miss is the processor's first step.
Anything else (a rotated photo, RGBA to convert, a palette image) is loaded
as vLLM loads it. The key is the same either way: the digest covers the
same bytes and the same (empty) decode settings.

The plugin registers it in vLLM's media connector registry as `mmcache` and
makes it the default (`VLLM_MEDIA_CONNECTOR=mmcache`) where nothing else was
chosen. A corrupt image whose header parses is then found by the processor
rather than at load: the request still fails with 400.
"""

from __future__ import annotations

from io import BytesIO
from typing import Any

from PIL import Image
from typing_extensions import override
from vllm.multimodal.media import MediaConnector, MediaWithBytes
from vllm.multimodal.media.image import ImageMediaIO

__all__ = ["CONNECTOR_NAME", "LazyImageMediaIO", "MMCacheMediaConnector"]

CONNECTOR_NAME = "mmcache"
_ORIENTATION = 0x0112  # EXIF: 1 (or none) means the pixels are stored upright


class LazyImageMediaIO(ImageMediaIO):  # type: ignore[misc]
    """vLLM's ImageMediaIO, leaving the decode to the first read of the pixels."""

    @classmethod
    def of(cls, media_io: ImageMediaIO) -> LazyImageMediaIO:
        """The same settings as `media_io` (vLLM's, as the connector made it)."""
        lazy = cls.__new__(cls)
        lazy.__dict__.update(media_io.__dict__)
        return lazy

    @override
    def load_bytes(self, data: bytes) -> Any:
        image = _opened_as_is(data, self.image_mode)
        if image is None:
            return super().load_bytes(data)  # vLLM's own load, and its errors
        # vLLM 0.33 counts a request's decoded bytes against a limit as it
        # loads: the same charge, though the decode itself may never happen.
        budget = getattr(self, "decoded_budget", None)
        if budget is not None:
            try:
                budget.charge(image.size[0] * image.size[1] * 4)
            except ValueError:
                image.close()
                raise
        return MediaWithBytes(image, data, None)


def _opened_as_is(data: bytes, mode: str | None) -> Image.Image | None:
    """The image opened (not decoded) if loading it would change nothing but
    the timing; None where vLLM's own load must run (it also gives the errors)."""
    from vllm import envs

    try:
        image = _open(data)
        width, height = image.size
        limit = envs.VLLM_MAX_IMAGE_PIXELS
        if limit > 0 and width * height > limit:
            return None
        if image.getexif().get(_ORIENTATION, 1) != 1:
            return None
    except (OSError, ValueError, Image.DecompressionBombError):
        return None
    if mode is not None and image.mode != mode:
        return None
    if "transparency" in image.info:  # vLLM 0.33 flattens it even in the mode asked for
        return None
    return image


def _open(data: bytes) -> Image.Image:
    try:  # vLLM 0.32: only the formats it serves
        from vllm.multimodal.image import open_image
    except ImportError:  # vLLM 0.31
        return Image.open(BytesIO(data))
    opened: Image.Image = open_image(BytesIO(data))
    return opened


class MMCacheMediaConnector(MediaConnector):  # type: ignore[misc]
    """vLLM's media connector, whose images decode lazily (see the module)."""

    @override
    def load_from_url(self, url: str, media_io: Any, *args: Any, **kwargs: Any) -> Any:
        return super().load_from_url(url, _lazy(media_io), *args, **kwargs)

    @override
    async def load_from_url_async(self, url: str, media_io: Any, *args: Any, **kwargs: Any) -> Any:
        return await super().load_from_url_async(url, _lazy(media_io), *args, **kwargs)


def _lazy(media_io: Any) -> Any:
    # Exactly vLLM's image loader: a subclass (another plugin's) is left alone.
    return LazyImageMediaIO.of(media_io) if type(media_io) is ImageMediaIO else media_io


def register_connector() -> bool:
    """Add the connector to vLLM's registry; False where this vLLM has none."""
    try:
        from vllm.multimodal.media import MEDIA_CONNECTOR_REGISTRY
    except ImportError:
        return False
    MEDIA_CONNECTOR_REGISTRY.register(CONNECTOR_NAME)(MMCacheMediaConnector)
    return True
