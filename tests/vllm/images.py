"""Media as the tests send them, as data URLs: small PNGs of one colour each,
and short MP4 videos of one colour each (a band moving down its four frames)."""

from __future__ import annotations

import base64
import io
from typing import Any


def data_url(color: str) -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (100, 80), color).save(buffer, "PNG")  # 12 image tokens
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def video_url(color: str) -> str:
    """Four 56x56 frames (8 video tokens on the tests' Qwen2-VL), MPEG-4."""
    import os
    import tempfile

    import cv2
    import numpy as np
    from PIL import ImageColor

    red, green, blue = ImageColor.getrgb(color)[:3]
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "video.mp4")
        writer = cv2.VideoWriter(path, cv2.VideoWriter.fourcc(*"mp4v"), 4, (56, 56))
        for frame_index in range(4):
            frame = np.empty((56, 56, 3), np.uint8)
            frame[:] = (blue, green, red)  # OpenCV's order
            frame[frame_index * 14 : frame_index * 14 + 14, :] = 128
            writer.write(frame)
        writer.release()
        with open(path, "rb") as file:
            data = file.read()
    return "data:video/mp4;base64," + base64.b64encode(data).decode()


def chat_messages(color: str, kind: str = "image") -> list[dict[str, Any]]:
    """One user turn: a `color` image (or video, `kind="video"`) and a question."""
    media = (
        {"type": "video_url", "video_url": {"url": video_url(color)}}
        if kind == "video"
        else {"type": "image_url", "image_url": {"url": data_url(color)}}
    )
    return [
        {"role": "user", "content": [media, {"type": "text", "text": f"What is in this {kind}?"}]}
    ]
