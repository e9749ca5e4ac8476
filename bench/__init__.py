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
        # Once: a second SIGTERM must not cut the cleanup the first began.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
