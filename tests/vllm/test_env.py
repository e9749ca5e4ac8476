"""The vLLM test environment (scripts/vllm-env.sh) serves what users send:
audio too, decoded by PyAV where torchcodec cannot load."""

from __future__ import annotations

import io
import math
import struct
import wave


def test_vllms_audio_loader_decodes_a_wav_in_this_environment() -> None:
    try:
        from vllm.multimodal.media.audio import AudioMediaIO
    except ImportError:  # vLLM 0.31
        from vllm.multimodal.audio import AudioMediaIO
    wav = io.BytesIO()
    with wave.open(wav, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(16000)
        out.writeframes(
            b"".join(struct.pack("<h", int(1000 * math.sin(i / 10))) for i in range(16000))
        )
    audio, rate = AudioMediaIO().load_bytes(wav.getvalue())
    assert rate == 16000 and audio.shape[-1] == 16000
