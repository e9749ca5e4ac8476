"""The EC connector's staged files: what a worker loads is what was staged,
bytes staged at once stay under the budget, and nothing outlives its use."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmcache.client.vllm._staging import Staging, load_staged


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_worker_loads_exactly_what_was_staged(tmp_path: Path, dtype: torch.dtype) -> None:
    staging = Staging(1 << 20, str(tmp_path))
    output = torch.randn(12, 64).to(dtype)
    staged = staging.put("img-1", output[:, :48])  # a non-contiguous view, as vLLM may hold
    assert staged is not None and staged.shape == (12, 48)
    loaded = load_staged(staged.path, staged.dtype, staged.shape, "cpu")
    assert loaded.dtype == dtype and torch.equal(loaded, output[:, :48])
    assert staged.nbytes == 12 * 48 * loaded.element_size()
    assert "img-1" in staging and staging.get("img-1") is staged
    # The worker's tensor is its own: removing the file does not touch it.
    staging.drop("img-1")
    assert not Path(staged.path).exists() and torch.equal(loaded, output[:, :48])


def test_the_budget_bounds_the_bytes_staged_at_once(tmp_path: Path) -> None:
    staging = Staging(2 * 1024, str(tmp_path))  # room for two 1 KiB outputs
    one_kib = torch.zeros(256, dtype=torch.float32)
    assert staging.put("a", one_kib) is not None
    assert staging.put("b", one_kib) is not None
    assert staging.put("c", one_kib) is None  # over the budget: vLLM encodes it
    assert staging.staged_bytes == 2048 and "c" not in staging
    assert staging.put("a", one_kib) is staging.get("a")  # staged once
    staging.drop("a")
    assert staging.put("c", one_kib) is not None and staging.staged_bytes == 2048


def test_engines_stage_apart_and_close_removes_everything(tmp_path: Path) -> None:
    first, second = Staging(1 << 20, str(tmp_path)), Staging(1 << 20, str(tmp_path))
    assert first.directory != second.directory  # data-parallel engines on one host
    a = first.put("same", torch.ones(4))
    b = second.put("same", torch.full((4,), 2.0))
    assert a is not None and b is not None and a.path != b.path
    # Written whole, then renamed: no partial file is ever left to be read.
    files = sorted(p.name for p in Path(first.directory).iterdir())
    assert files == sorted([".lock", Path(a.path).name])
    first.close()
    assert not Path(first.directory).exists() and Path(b.path).exists()
    second.drop("missing")  # dropping what is not staged is no error
    second.close()
    assert list(tmp_path.iterdir()) == []


def test_a_killed_engines_files_are_removed_by_the_next_one(tmp_path: Path) -> None:
    # A scheduler in another process holds its directory's lock while it lives.
    code = (
        "import sys, time, torch; from mmcache.client.vllm._staging import Staging; "
        "s = Staging(1 << 20, sys.argv[1]); s.put('x', torch.ones(8)); "
        "print(s.directory, flush=True); time.sleep(60)"
    )
    dying = code.replace("time.sleep(60)", "os._exit(9)").replace("import sys", "import os, sys")
    alive = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert alive.stdout is not None
        # The live one must have made its directory (and swept) before the other dies,
        # or its own start-up sweep removes the dead one's directory first.
        live_dir = Path(alive.stdout.readline().strip())
        killed = subprocess.run(
            [sys.executable, "-c", dying, str(tmp_path)],
            capture_output=True,
            text=True,
            check=False,
        )
        dead_dir = Path(killed.stdout.strip())
        assert dead_dir.exists() and live_dir.exists()
        fresh = Staging(1 << 20, str(tmp_path))
        assert not dead_dir.exists()  # its lock was free: nobody stages there
        assert live_dir.exists() and any(live_dir.iterdir())  # held: kept
        fresh.close()
    finally:
        alive.kill()
        alive.wait()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_worker_on_a_gpu_loads_onto_its_device(tmp_path: Path) -> None:
    staging = Staging(1 << 20, str(tmp_path))
    output = torch.randn(12, 64, device="cuda").to(torch.bfloat16)
    staged = staging.put("img", output)  # copied off the device to stage
    assert staged is not None
    loaded = load_staged(staged.path, staged.dtype, staged.shape, "cuda:0")
    assert loaded.device.type == "cuda" and torch.equal(loaded, output)
    staging.close()
