"""Every Python block of README.md and docs/*.md runs as written: each one, as
its own program, against a real server process at MMCACHE_TARGET."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import MMCACHE
from .test_process import free_port, wait_serving

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.DOTALL | re.MULTILINE)


def blocks() -> list[tuple[str, str]]:
    """(where, code) of every Python block of the README and the docs."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        for match in BLOCK.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append((f"{path.relative_to(ROOT)}:{line}", match.group(1)))
    return found


@pytest.fixture(scope="module")
def target() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [MMCACHE, "serve", "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0",
         "--grace-s", "0", "--log-level", "WARNING"],
        text=True,
    )  # fmt: skip
    try:
        wait_serving(port, proc)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(20)


def test_the_docs_have_python_blocks_to_run() -> None:
    assert len(blocks()) >= 5


@pytest.mark.parametrize(("where", "code"), blocks(), ids=[where for where, _ in blocks()])
def test_a_python_block_of_the_docs_runs_as_written(
    where: str, code: str, target: str, tmp_path: Path
) -> None:
    program = tmp_path / "example.py"
    program.write_text(code)
    done = subprocess.run(
        [sys.executable, str(program)],
        env={**os.environ, "MMCACHE_TARGET": target},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, f"{where}:\n{done.stderr[-3000:]}"
