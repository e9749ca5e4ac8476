"""CUDA tensors through the EC connector's copies and a real server: run on a
machine with a GPU (skipped elsewhere; bench/gpu_copies.py times them).

Each copy must leave the engine's thread free while the GPU still works
(checked by the stream's `query()`, not by a clock) and arrive whole."""

from __future__ import annotations

import pytest
import torch

from mmcache.client import BatchedField, FieldElem, MMCacheClient, MMItem
from mmcache.client.vllm._staging import Staging, load_staged, to_host

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device (run on a GPU machine)"
)

# About a second of queued GPU work at 2 GHz: far longer than any copy here.
_BUSY_CYCLES = 2_000_000_000


def _encoder_output() -> torch.Tensor:
    """A Qwen2-VL-sized encoder output of a 1024x1024 image: 1369 tokens of 1536."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    return torch.randn(1369, 1536, device="cuda", dtype=torch.bfloat16, generator=generator)


def test_a_host_copy_does_not_wait_for_the_gpu_and_arrives_whole() -> None:
    output = _encoder_output()
    expected = (output * 2).cpu()
    torch.cuda.synchronize()
    torch.cuda._sleep(_BUSY_CYCLES)
    later = output * 2  # queued behind the busy work, as an encoder's output is
    host, copied = to_host(later)
    assert not torch.cuda.current_stream().query()  # the caller did not wait
    assert copied is not None and host.device.type == "cpu" and host.is_pinned()
    copied()
    assert torch.equal(host, expected)


def test_a_staged_load_onto_the_gpu_does_not_wait_and_is_whole() -> None:
    output = _encoder_output().cpu()
    staging = Staging(budget_bytes=64 << 20)
    try:
        staged = staging.put("image", output)
        assert staged is not None
        torch.cuda.synchronize()
        torch.cuda._sleep(_BUSY_CYCLES)
        loaded = load_staged(staged.path, staged.dtype, staged.shape, "cuda:0")
        assert not torch.cuda.current_stream().query()
        staging.drop("image")  # the worker's copy outlives the file
        assert loaded.device.type == "cuda"
        assert torch.equal(loaded.cpu(), output)  # ordered after the load on the stream
        # With nothing queued, the driver's own copy: the same tensor.
        staged = staging.put("again", output)
        assert staged is not None
        torch.cuda.synchronize()
        idle = load_staged(staged.path, staged.dtype, staged.shape, "cuda:0")
        assert idle.device.type == "cuda" and torch.equal(idle.cpu(), output)
    finally:
        staging.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.uint8])
async def test_cuda_tensors_round_trip_through_a_real_server(
    client: MMCacheClient, dtype: torch.dtype
) -> None:
    """A GPU's tensor stored (the codec copies it to the CPU), fetched, and put
    back on the GPU equal, at each dtype an engine keeps."""
    source = (_encoder_output() * 7).to(dtype)
    item = MMItem.from_elems([FieldElem("image", "pixel_values", source, BatchedField())])
    reply = await client.get_and_update([item], ["gpu-item"], lease=True)
    assert reply.held == [True]
    (fetched,) = await client.fetch(["gpu-item"])
    on_gpu = fetched["pixel_values"].data.to("cuda")
    assert on_gpu.dtype == dtype and torch.equal(on_gpu, source)
