"""Benchmarks that print tables (`make bench`; docs/benchmarks.md)."""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

__all__ = ["cpu_seconds", "stop_on_sigterm", "thread_cpu_ns"]


def cpu_seconds(pid: int) -> float:
    """CPU seconds of process `pid` so far, every thread (ended ones too), in
    clock ticks (Linux)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def thread_cpu_ns(pid: int | str = "self") -> dict[int, tuple[str, int]]:
    """Each live thread of process `pid`: its name and CPU nanoseconds so far,
    from its schedstat (/proc's tick is 10 ms); {} for a process gone."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    threads = {}
    for tid in tids:
        path = f"/proc/{pid}/task/{tid}"
        try:
            with open(f"{path}/comm", encoding="utf-8") as comm:
                name = comm.read().strip()
            with open(f"{path}/schedstat", encoding="ascii") as stat:
                threads[int(tid)] = (name, int(stat.read().split()[0]))
        except (OSError, ValueError, IndexError):  # a thread that ended meanwhile
            continue
    return threads


def stop_on_sigterm() -> None:
    """SIGTERM (a `timeout`, a CI job's end, `kill`) unwinds the bench as
    Ctrl-C does, so the deployments it started stop with it: Python's default
    for SIGTERM ends the process at once and leaves them running."""

    def stop(signum: int, frame: FrameType | None) -> None:
        # Once: a second SIGTERM must not cut the cleanup the first began.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
