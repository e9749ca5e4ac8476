"""Benchmarks that print tables (`make bench`; docs/benchmarks.md)."""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

__all__ = ["cpu_seconds", "stop_on_sigterm"]


def cpu_seconds(pid: int) -> float:
    """CPU seconds of process `pid` so far, every thread (ended ones too), in
    clock ticks (Linux)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def stop_on_sigterm() -> None:
    """SIGTERM (a `timeout`, a CI job's end, `kill`) unwinds the bench as
    Ctrl-C does, so the deployments it started stop with it: Python's default
    for SIGTERM ends the process at once and leaves them running."""

    def stop(signum: int, frame: FrameType | None) -> None:
        # Once: a second SIGTERM must not cut the cleanup the first began.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
