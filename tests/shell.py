"""A documented shell block run as a person runs it: bash, `set -e`, from the
repository's root, its output in a log; whatever it left running (servers
started with `&`) stopped afterwards, with its process group."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_block(script: str, log: Path, env: dict[str, str], timeout: float = 600) -> tuple[int, str]:
    """The block's exit status and what it printed."""
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            ["bash", "-c", f"set -e\n{script}"],
            cwd=ROOT,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # the block's children go with it
            env=env,
        )
    try:
        proc.wait(timeout)
        return proc.returncode, log.read_text(errors="replace")
    finally:
        with contextlib.suppress(ProcessLookupError):  # the servers it left running
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
