"""Images as the tests send them: small PNGs, one color each, as data URLs."""

from __future__ import annotations

import base64
import io
from typing import Any


def data_url(color: str) -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (100, 80), color).save(buffer, "PNG")  # 12 image tokens
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def chat_messages(color: str) -> list[dict[str, Any]]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url(color)}},
                {"type": "text", "text": "What is in this image?"},
            ],
        }
    ]
