"""Files whose owner is gone: a live process holds an `flock` on its own.

The server's shared-memory region and the EC connector's staging directories
are left behind by a process that is killed; the next one removes them. Each
owner locks its file for as long as it lives (and makes it under a name the
scan does not match until it holds the lock), so a file whose lock can be
taken has no owner, in any PID namespace that shares the file system.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterable, Iterator

__all__ = ["unlocked"]


def unlocked(paths: Iterable[str]) -> Iterator[str]:
    """The `paths` whose lock nobody holds (each taken and let go at once)."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            continue  # gone meanwhile, or not ours to open
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its owner is alive
        finally:
            os.close(fd)
        yield path
