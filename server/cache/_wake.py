"""The server's end of the region's wake pipe (mmcache._wake): a FIFO beside
the region file that co-located clients poke after posting an upload, so
the rings are read at once, with no timer running while uploads come."""

from __future__ import annotations

import contextlib
import logging
import os

from mmcache._wake import POKE, wake_path

__all__ = ["WakePipe"]

_LOGGER = logging.getLogger(__name__)

_READ_BYTES = 64 << 10  # a pipe's whole buffer on Linux; a multiple of POKE.size


class WakePipe:
    """The FIFO, open to read (non-blocking) and to write: a reader with no
    writer would read end-of-file, and wake its loop, for ever."""

    def __init__(self, path: str, fd: int, keep: int) -> None:
        self.path = path
        self.fd = fd
        self._keep = keep

    @classmethod
    def open(cls, region_path: str, *, group: int | None) -> WakePipe | None:
        """Make the pipe of the region at `region_path`, with the region's mode
        and group; None (logged: the rings are then read on a timer) where it
        cannot be made."""
        path = wake_path(region_path)
        mode = 0o600 if group is None else 0o660
        fds: list[int] = []
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # a dead server's, whose region went before it
            os.mkfifo(path, mode)
            fds.append(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW))
            fds.append(os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW))
            if group is not None:
                os.fchown(fds[0], -1, group)
            os.fchmod(fds[0], mode)  # whatever the umask took away
        except OSError as exc:
            _LOGGER.info("no wake pipe (posted uploads are read every few ms): %s", exc)
            for fd in fds:
                os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            return None
        return cls(path, *fds)

    def read(self) -> list[int]:
        """The leases of the rings that poked since the last read. A poke is 8
        bytes written at once, so whole ones are read; stray bytes (a writer
        that is no client) are dropped, and cost only a read of the rings."""
        leases: list[int] = []
        while True:
            try:
                data = os.read(self.fd, _READ_BYTES)
            except OSError:  # nothing more (BlockingIOError), or the pipe broke
                return leases
            whole = len(data) - len(data) % POKE.size
            leases.extend(lease for (lease,) in POKE.iter_unpack(data[:whole]))
            if len(data) < _READ_BYTES:
                return leases

    def close(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        for fd in (self.fd, self._keep):
            with contextlib.suppress(OSError):
                os.close(fd)
