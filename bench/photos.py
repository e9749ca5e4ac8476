"""Photo-like JPEGs made locally: the images bench/vllm.py sends.

A photo compresses far worse than a flat test card: smooth shading, edges
and fine grain. Each image here is a few soft blobs of colour over a
gradient, with sensor-like noise, saved at JPEG quality 90: a 1024x1024 one
is about 0.5 MB, as a camera's photo of that size is. Made from a seed, so a
run's images are the same every time, and distinct seeds give distinct
images (distinct content hashes for vLLM and mmcache alike).
"""

from __future__ import annotations

import base64
import io

import numpy as np

__all__ = ["SIZES", "data_url", "jpeg"]

# The sizes the issue measures: a small square, HD, a 1 MP square, full HD.
SIZES = ((448, 448), (1280, 720), (1024, 1024), (1920, 1080))


def jpeg(width: int, height: int, seed: int, quality: int = 90) -> bytes:
    """A photo-like JPEG of `width` x `height`, the same for the same seed."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    x /= width
    y /= height
    image = np.empty((height, width, 3), np.float32)
    for channel in range(3):
        a, b, c = rng.uniform(-80, 80, 3)
        image[..., channel] = 128 + a * x + b * y + c * x * y
    for _ in range(6):  # soft blobs of colour, as objects out of focus
        cx, cy, radius = rng.uniform(0, 1), rng.uniform(0, 1), rng.uniform(0.05, 0.3)
        blob = np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (2 * radius**2))
        image += blob[..., None] * rng.uniform(-90, 90, 3).astype(np.float32)
    image += rng.normal(0, 17, image.shape).astype(np.float32)  # grain
    pixels = np.clip(image, 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


def data_url(width: int, height: int, seed: int) -> str:
    """The JPEG as an OpenAI-style `image_url` data URL."""
    return "data:image/jpeg;base64," + base64.b64encode(jpeg(width, height, seed)).decode()
