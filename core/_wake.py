"""The region's wake pipe: how a co-located client that posted an upload in
its report ring (mmcache._rings) tells its server to read the rings now,
instead of the server reading them every few ms while uploads come.

The server makes a FIFO beside its region file (`wake_path`), with the
region's mode and group, and waits on it in its event loop. A client that
wrote an upload's record writes one `POKE` after it: its ring's lease, 8
bytes (under PIPE_BUF, so never torn). The server, woken, reads the pokes,
then every ring: the record is there, as its write came first. A client pokes
once as soon as it has its ring, too, so the server knows it pokes before
its first post (one read by another drain before its poke). A poke is a
hint, never data: a lost one (the pipe full, the server gone) costs only the
wait until the next read, and a forged one a read of rings with nothing new.
A server that finds a ring posting with no poke (an older client) reads the
rings every few ms, as before the pipe.
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import struct
import threading
from collections.abc import Iterator

__all__ = ["POKE", "WAKE_SUFFIX", "Poker", "wake_path"]

WAKE_SUFFIX = ".wake"
POKE = struct.Struct("<Q")  # the poking ring's lease


def wake_path(region_path: str) -> str:
    """The wake pipe of the region file at `region_path`."""
    return region_path + WAKE_SUFFIX


class Poker:
    """A client's end of a region's wake pipe: `poke` writes, never blocks;
    from any thread (the lock keeps a write off a descriptor being closed,
    whose number the process may give to another file)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._lock = threading.Lock()

    @classmethod
    def open(cls, region_path: str) -> Poker | None:
        """The region's wake pipe opened to write, or None where there is none
        (an older server, a file system with no FIFOs) or no reader."""
        flags = os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY
        try:
            fd = os.open(wake_path(region_path), flags)
        except OSError:
            return None
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            os.close(fd)
            return None
        return cls(fd)

    def poke(self, lease: int) -> bool:
        """Tell the server that the ring of `lease` holds a new record; False
        where the pipe took nothing (full: the server wakes anyway; or gone)."""
        with self._lock, _no_sigpipe():
            if self._fd < 0:
                return False
            try:
                return os.write(self._fd, POKE.pack(lease)) == POKE.size
            except BlockingIOError:
                return False
            except OSError:  # the server closed it (stopped): no more pokes
                self._close()
                return False

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)


@contextlib.contextmanager
def _no_sigpipe() -> Iterator[None]:
    """A write to a pipe whose reader is gone raises SIGPIPE, which kills a
    process that left it at its default (Python ignores it; its host may not):
    blocked on this thread meanwhile, and any it raised taken before it is
    unblocked, so the write fails with EPIPE and nothing else happens."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGPIPE})
    try:
        yield
    finally:
        if signal.SIGPIPE not in blocked:
            signal.sigtimedwait({signal.SIGPIPE}, 0)  # None when none is pending
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
