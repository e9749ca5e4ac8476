"""Memory for the large tensors a read hands out, used again once they are dropped.

A fetched tensor is new memory, and the kernel zeroes every page of new
memory at its first touch: for a 64 MiB tensor that costs more than copying
the bytes in (glibc maps allocations of 32 MiB and up afresh every time). An
engine reads items of the same few sizes over and over, so the client keeps
the buffers of the tensors it handed out: when the caller drops a tensor
(and every view of it), its buffer returns here, pages still mapped, and the
next read of that size fills it at memory speed.

The caller owns what it gets (contiguous, writable, nobody else's until it
drops it); the pool only keeps dropped buffers, at most `keep_bytes` of
them, the oldest given up first.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

import numpy
import torch

from mmcache._memory import advise_hugepages

__all__ = ["MIN_POOLED_BYTES", "BufferPool"]

# Smaller buffers come back warm from malloc's own free lists. From here up
# they may not: an engine reading a 1.2 MB item (a 448x448 image's) every
# few milliseconds took 0.35 ms of CPU a read in fresh memory, 0.14 pooled.
MIN_POOLED_BYTES = 1 << 20
_CLASS = 2 << 20  # sizes round up to huge pages: one class serves nearby sizes
_SMALL_CLASS = 256 << 10  # below a class, finer: a 1.2 MB item does not take 2 MiB


class BufferPool:
    """Byte buffers of at least MIN_POOLED_BYTES, recycled when dropped."""

    def __init__(self, keep_bytes: int) -> None:
        self.keep_bytes = keep_bytes
        self._idle: OrderedDict[int, numpy.ndarray] = OrderedDict()  # id -> buffer, oldest first
        self._idle_bytes = 0
        self._lock = threading.Lock()  # buffers come back from whichever thread drops them

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes

    def take(self, n: int) -> torch.Tensor:
        """A uint8 tensor of `n` bytes (contents undefined), the caller's own."""
        step = _CLASS if n >= _CLASS else _SMALL_CLASS
        size = -(-n // step) * step
        base = self._reuse(size)
        if base is None:
            base = numpy.empty(size, dtype=numpy.uint8)
            advise_hugepages(base.ctypes.data, size)
        view = base[:n]
        # The tensor keeps `view` alive, and every tensor made from it too.
        weakref.finalize(view, self._give_back, base)
        return torch.from_numpy(view)

    def _reuse(self, size: int) -> numpy.ndarray | None:
        with self._lock:
            for key, base in self._idle.items():
                if base.nbytes == size:
                    del self._idle[key]
                    self._idle_bytes -= size
                    return base
        return None

    def _give_back(self, base: numpy.ndarray) -> None:
        if base.nbytes > self.keep_bytes:
            return
        with self._lock:
            self._idle[id(base)] = base
            self._idle_bytes += base.nbytes
            while self._idle_bytes > self.keep_bytes:
                _, oldest = self._idle.popitem(last=False)
                self._idle_bytes -= oldest.nbytes
