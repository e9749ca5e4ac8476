"""Encoder outputs staged for one engine's workers, in files of its own.

The EC connector's scheduler may tell vLLM an item is cached only when the
worker's load cannot fail: vLLM asserts on a failed load and the engine dies.
So the scheduler first copies the item out of the sidecar into a file here
(tmpfs by default), and only then answers "cached"; the worker loads that
file, whatever the sidecar does meanwhile. Files are written whole and then
renamed, so a worker never sees a partial one, and the bytes staged at once
are bounded: past the bound an item is simply not staged (vLLM encodes it).

Each scheduler stages in a directory of its own, locked (`flock`) for as long
as its process lives; a new one removes the directories whose lock it can
take, left by engines that were killed. Used from one thread (the scheduler's).
Nothing here speaks to the sidecar or to vLLM: torch and the file system only.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import itertools
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mmcache._lockfiles import unlocked

__all__ = ["Staged", "Staging", "load_staged"]

_PREFIX = "mmcache-ec-"
_LOCK = ".lock"
_tokens = itertools.count(1)


@dataclass
class Staged:
    """One staged encoder output: where it is and how to read it back."""

    path: str
    dtype: str  # torch dtype name, e.g. "bfloat16"
    shape: tuple[int, ...]
    nbytes: int
    token: int = field(default_factory=lambda: next(_tokens))  # this staging of it, not a later one
    requests: set[str] = field(default_factory=set)  # live requests it was handed to
    idle_since: float = field(default_factory=time.monotonic)  # no request has it since
    handed: bool = False  # named in a step's loads at least once
    loads_in_flight: int = 0  # steps that name it and have not come back from the workers


class Staging:
    """Staged files by identifier, at most `budget_bytes` of them at once.

    Usage (on the scheduler side)::

        staging = Staging(budget_bytes=1 << 30)
        staged = staging.put("img-hash", tensor)   # None: over the budget
        ... hand staged.path to the workers; after the requests end:
        staging.drop("img-hash")
    """

    def __init__(self, budget_bytes: int, parent: str | None = None) -> None:
        self.budget_bytes = budget_bytes
        parent = parent or _default_parent() or tempfile.gettempdir()
        for lock in unlocked(glob.glob(os.path.join(parent, _PREFIX + "*", _LOCK))):
            shutil.rmtree(os.path.dirname(lock), ignore_errors=True)  # a killed engine's
        # A directory of this scheduler's own: two engines on one host (data
        # parallelism) stage the same identifier without touching each other.
        # Made under a name the scan above does not match, and renamed once
        # locked: a neighbour starting meanwhile never takes it for abandoned.
        making = tempfile.mkdtemp(prefix="." + _PREFIX, dir=parent)
        self._lock = os.open(os.path.join(making, _LOCK), os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self.directory = os.path.join(parent, os.path.basename(making)[1:])
        os.rename(making, self.directory)
        self._items: dict[str, Staged] = {}
        self._bytes = 0

    def __contains__(self, identifier: str) -> bool:
        return identifier in self._items

    def get(self, identifier: str) -> Staged | None:
        return self._items.get(identifier)

    @property
    def staged_bytes(self) -> int:
        return self._bytes

    def items(self) -> list[tuple[str, Staged]]:
        return list(self._items.items())

    def put(self, identifier: str, tensor: torch.Tensor) -> Staged | None:
        """Write `tensor` for `identifier`; None when it would pass the budget.
        OSError (a full file system) leaves nothing behind."""
        if identifier in self._items:
            return self._items[identifier]
        nbytes = tensor.nbytes
        if self._bytes + nbytes > self.budget_bytes:
            return None
        data = tensor.detach().to("cpu").contiguous()
        name = hashlib.blake2b(identifier.encode(), digest_size=16).hexdigest()
        path = os.path.join(self.directory, name)
        partial = path + ".partial"
        try:
            data.view(torch.uint8).reshape(-1).numpy().tofile(partial)
            os.replace(partial, path)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(partial)
            raise
        staged = Staged(path, str(data.dtype).removeprefix("torch."), tuple(data.shape), nbytes)
        self._items[identifier] = staged
        self._bytes += nbytes
        return staged

    def drop(self, identifier: str) -> None:
        """Forget `identifier` and remove its file (a worker that mapped it keeps
        its copy)."""
        staged = self._items.pop(identifier, None)
        if staged is None:
            return
        self._bytes -= staged.nbytes
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staged.path)

    def close(self) -> None:
        self._items.clear()
        self._bytes = 0
        shutil.rmtree(self.directory, ignore_errors=True)
        os.close(self._lock)


def load_staged(path: str, dtype: str, shape: tuple[int, ...], device: str) -> torch.Tensor:
    """The staged tensor, as a tensor of the worker's own on `device`.

    On a GPU the copy is queued on the current stream from pinned memory, and
    the worker's thread goes on: a copy from pageable memory would wait for
    all the work queued before it (a whole forward pass, with vLLM's async
    scheduling). What runs later on that stream sees the tensor whole."""
    torch_dtype = getattr(torch, dtype)
    nbytes = torch.Size(shape).numel() * torch_dtype.itemsize
    # Owned memory: the scheduler removes the file once the request ends.
    # A stream with nothing queued has nothing to wait for, and the driver's
    # own copy from pageable memory is then the faster (3.7 against 4.6 ms
    # for 22 MB on an H200: bench/gpu_copies.py).
    if not device.startswith("cuda") or torch.cuda.current_stream(device).query():
        raw = torch.from_file(path, shared=False, size=nbytes, dtype=torch.uint8)
        tensor = raw.view(torch_dtype).reshape(shape)
        return tensor.clone() if device == "cpu" else tensor.to(device)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    with open(path, "rb") as staged:
        if staged.readinto(pinned.numpy().data) != nbytes:
            raise OSError(f"staged file {path} holds fewer than {nbytes} bytes")
    # The caching host allocator keeps `pinned` from reuse until the copy is done.
    return pinned.view(torch_dtype).reshape(shape).to(device, non_blocking=True)


def to_host(tensor: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None] | None]:
    """A copy of `tensor` on the CPU, and a wait that returns once it is
    complete (None: it is). On a GPU the copy is queued behind the stream's work into
    pinned memory, and the caller's thread does not wait for it (`.to("cpu")`
    would, for all the work queued before it); the wait then belongs to
    whoever reads the copy, off the engine's thread. Elsewhere a plain copy."""
    tensor = tensor.detach()
    if tensor.device.type != "cuda":
        return tensor.to("cpu", copy=True), None
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
    copied.record()
    return host, copied.synchronize


def _default_parent() -> str | None:
    # tmpfs when there is one: staging is a memory copy, not a disk write.
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None
