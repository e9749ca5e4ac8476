"""Benchmarks that print tables (`make bench`; docs/benchmarks.md)."""

from __future__ import annotations

import signal
import sys
from types import FrameType

__all__ = ["stop_on_sigterm"]


def stop_on_sigterm() -> None:
    """SIGTERM (a `timeout`, a CI job's end, `kill`) unwinds the bench as
    Ctrl-C does, so the deployments it started stop with it: Python's default
    for SIGTERM ends the process at once and leaves them running."""

    def stop(signum: int, frame: FrameType | None) -> None:
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
