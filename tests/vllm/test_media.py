"""The plugin's media connector (client/vllm/_media.py) with vLLM's own
loader beside it: a photo is opened, not decoded, and keyed as vLLM keys it;
an image whose load changes it loads as vLLM loads it; the plugin makes the
connector vLLM's default unless another was chosen. A corrupt image's 400 in
a real engine: tests/vllm/test_engine.py."""

from __future__ import annotations

import base64
import io
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image
from vllm.multimodal.hasher import MultiModalHasher
from vllm.multimodal.media import MediaConnector
from vllm.multimodal.media import base as media_base

from bench.photos import jpeg
from mmcache.client.vllm._media import MMCacheMediaConnector


def _url(data: bytes, kind: str) -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


def _key(image: object) -> str:
    return MultiModalHasher.hash_kwargs("blake3", model_id="m", image=image)


def _encoded(image: Image.Image, kind: str, **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, kind, **options)
    return buffer.getvalue()


def test_a_photo_is_opened_not_decoded_and_keyed_as_vllm_keys_it() -> None:
    url = _url(jpeg(640, 480, seed=3), "jpeg")
    eager = MediaConnector().fetch_image(url)
    lazy = MMCacheMediaConnector().fetch_image(url)
    assert lazy.media._im is None  # not decoded: a hit never will
    assert lazy.size == eager.size == (640, 480)
    assert _key(lazy) == _key(eager)
    assert np.array_equal(np.asarray(lazy.media), np.asarray(eager.media))  # decoded on use


@pytest.mark.parametrize(
    "kind",
    ["rotated jpeg", "rgba png", "grayscale jpeg", "palette png", "rgb png, a colour transparent"],
)
def test_an_image_whose_load_changes_it_loads_as_vllm_loads_it(kind: str) -> None:
    photo = Image.open(io.BytesIO(jpeg(120, 80, seed=4)))
    if kind == "rotated jpeg":
        exif = Image.Exif()
        exif[0x0112] = 6  # stored sideways: vLLM turns it upright
        data = _encoded(photo, "JPEG", exif=exif)
    elif kind == "rgba png":
        data = _encoded(photo.convert("RGBA"), "PNG")
    elif kind == "grayscale jpeg":
        data = _encoded(photo.convert("L"), "JPEG")
    elif kind.startswith("rgb png"):  # RGB as asked, yet vLLM 0.33 flattens it on white
        data = _encoded(photo, "PNG", transparency=photo.getpixel((0, 0)))
    else:
        data = _encoded(photo.convert("P"), "PNG")
    url = _url(data, "png" if "png" in kind else "jpeg")
    eager = MediaConnector().fetch_image(url)
    lazy = MMCacheMediaConnector().fetch_image(url)
    assert lazy.media._im is not None  # loaded (and converted) at once, as vLLM does
    assert (lazy.size, lazy.media.mode) == (eager.size, eager.media.mode) == (lazy.size, "RGB")
    assert _key(lazy) == _key(eager)
    assert np.array_equal(np.asarray(lazy.media), np.asarray(eager.media))


def test_a_bad_image_is_refused_as_vllm_refuses_it() -> None:
    with pytest.raises(ValueError, match="image"):
        MMCacheMediaConnector().fetch_image(_url(b"not an image at all", "jpeg"))


@pytest.mark.parametrize("chosen", [None, "http"])
def test_the_plugin_makes_the_connector_vllms_default_unless_another_was_chosen(
    chosen: str | None,
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_MEDIA_CONNECTOR"}
    env["MMCACHE_TARGET"] = "127.0.0.1:1"  # the plugin is active; nothing is called
    if chosen is not None:
        env["VLLM_MEDIA_CONNECTOR"] = chosen
    script = (
        "from mmcache.client.vllm import register\n"
        "from vllm import envs\n"
        "from vllm.multimodal.media import MEDIA_CONNECTOR_REGISTRY\n"
        "register()\n"
        "print(type(MEDIA_CONNECTOR_REGISTRY.load(envs.VLLM_MEDIA_CONNECTOR)).__name__)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    expected = "MediaConnector" if chosen == "http" else "MMCacheMediaConnector"
    assert done.stdout.strip().splitlines()[-1] == expected


def test_a_request_over_vllms_decode_budget_is_refused_as_vllm_refuses_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    budget_type = getattr(media_base, "MediaDecodedBudget", None)
    if budget_type is None:
        pytest.skip("this vLLM has no per-request decode budget (0.33 brought it)")
    # Room for one 640x480 image (4 bytes a pixel), not two: the lazy load
    # charges what vLLM's decode would, though it decodes nothing.
    monkeypatch.setenv("VLLM_MAX_MEDIA_REQUEST_DECODE_BYTES", str(640 * 480 * 4 + 1))
    url = _url(jpeg(640, 480, seed=5), "jpeg")
    for connector_type in (MediaConnector, MMCacheMediaConnector):
        connector = connector_type(decoded_budget=budget_type())
        assert connector.fetch_image(url).size == (640, 480)
        with pytest.raises(ValueError, match="VLLM_MAX_MEDIA_REQUEST_DECODE_BYTES"):
            connector.fetch_image(url)
