"""What the EC connector's copies cost an engine's thread on a GPU: the save
of an encoder output to the host, and the load of a staged one onto the GPU,
the way they were (`.to("cpu")`, a pageable `.to("cuda")`) beside the way
they are (client/vllm/_staging.py: pinned memory, queued on the
stream, waited for off the engine's thread). Needs a CUDA device.

    python -m bench.gpu_copies [--busy-ms 20] [--reps 20]

Each copy is timed on the calling thread with `--busy-ms` of GPU work queued
before it (a forward pass in flight, as under vLLM's async scheduling), and
with the GPU idle. Sizes: a 1024x1024 image's encoder output (1369 tokens)
at hidden sizes 1536 (Qwen2-VL-2B) and 8192 (Qwen2.5-VL-72B), in bf16.
Prints a table.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from mmcache.client.vllm._staging import Staged, Staging, load_staged, to_host

SIZES = {"1369 x 1536 bf16": (1369, 1536), "1369 x 8192 bf16": (1369, 8192)}


def _cycles_per_ms() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(100_000_000)
    end.record()
    end.synchronize()
    return 100_000_000 / start.elapsed_time(end)


def _timed(call: Callable[[], object], busy_cycles: int, reps: int) -> float:
    """Median ms the calling thread spends in `call`, GPU work queued before it."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        if busy_cycles:
            torch.cuda._sleep(busy_cycles)
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
        torch.cuda.synchronize()
    return statistics.median(times) * 1e3


def _rows(label: str, output: torch.Tensor, staged: Staged, busy: int, reps: int) -> None:
    """The table's two rows for one encoder output."""
    waits: list[float] = []

    def save_before() -> None:
        output.detach().to("cpu", copy=True)

    def save_now() -> None:
        to_host(output)

    def save_and_wait() -> None:
        _, copied = to_host(output)
        start = time.perf_counter()
        assert copied is not None
        copied()
        waits.append(time.perf_counter() - start)

    def load_before() -> None:
        raw = torch.from_file(staged.path, shared=False, size=staged.nbytes, dtype=torch.uint8)
        raw.view(torch.bfloat16).reshape(staged.shape).to("cuda")

    def load_now() -> None:
        load_staged(staged.path, staged.dtype, staged.shape, "cuda")

    for what, before, now in (
        ("save (to host)", save_before, save_now),
        ("load (staged)", load_before, load_now),
    ):
        old = [_timed(before, b, reps) for b in (busy, 0)]
        new = [_timed(now, b, reps) for b in (busy, 0)]
        wait = "-"
        if what.startswith("save"):
            _timed(save_and_wait, busy, reps)
            wait = f"{statistics.median(waits) * 1e3:.2f}"
        print(
            f"| {label} ({output.nbytes / 1e6:.1f} MB) | {what} "
            f"| {old[0]:.2f} / {old[1]:.2f} | {new[0]:.2f} / {new[1]:.2f} | {wait} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--busy-ms", type=float, default=20.0)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.gpu_copies needs a CUDA device")
    busy = int(args.busy_ms * _cycles_per_ms())
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.busy_ms:g} ms queued")
    print(
        "\n| output | copy | before: GPU busy / idle, ms | now: GPU busy / idle, ms "
        "| now: the wait, off the engine's thread, busy ms |"
    )
    print("|---|---|---|---|---|")
    staging = Staging(budget_bytes=1 << 30)
    try:
        for label, shape in SIZES.items():
            output = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
            staged = staging.put(label, output)
            assert staged is not None
            _rows(label, output, staged, busy, args.reps)
    finally:
        staging.close()


if __name__ == "__main__":
    main()
