"""Encoder outputs staged for one engine's workers, in files of its own.

The EC connector's scheduler may tell vLLM an item is cached only when the
worker's load cannot fail: vLLM asserts on a failed load and the engine dies.
So the scheduler first copies the item out of the sidecar into a file here
(tmpfs by default), and only then answers "cached"; the worker loads that
file, whatever the sidecar does meanwhile. Files are written whole and then
renamed, so a worker never sees a partial one, and the bytes staged at once
are bounded: past the bound an item is simply not staged (vLLM encodes it).

Nothing here speaks to the sidecar or to vLLM: torch and the file system only.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field

import torch

__all__ = ["Staged", "Staging", "load_staged"]


@dataclass
class Staged:
    """One staged encoder output: where it is and how to read it back."""

    path: str
    dtype: str  # torch dtype name, e.g. "bfloat16"
    shape: tuple[int, ...]
    nbytes: int
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
        # A directory of this scheduler's own: two engines on one host (data
        # parallelism) stage the same identifier without touching each other.
        self.directory = tempfile.mkdtemp(prefix="mmcache-ec-", dir=parent or _default_parent())
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
        """Write `tensor` for `identifier`; None when it would pass the budget."""
        data = tensor.detach().to("cpu").contiguous()
        nbytes = data.numel() * data.element_size()
        if identifier in self._items:
            return self._items[identifier]
        if self._bytes + nbytes > self.budget_bytes:
            return None
        name = hashlib.blake2b(identifier.encode(), digest_size=16).hexdigest()
        path = os.path.join(self.directory, name)
        partial = path + ".partial"
        data.view(torch.uint8).reshape(-1).numpy().tofile(partial)
        os.replace(partial, path)
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


def load_staged(path: str, dtype: str, shape: tuple[int, ...], device: str) -> torch.Tensor:
    """The staged tensor, as a tensor of the worker's own on `device`."""
    torch_dtype = getattr(torch, dtype)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=torch_dtype).element_size()
    raw = torch.from_file(path, shared=False, size=nbytes, dtype=torch.uint8)
    tensor = raw.view(torch_dtype).reshape(shape)
    # Owned memory: the scheduler removes the file once the request ends.
    return tensor.clone() if device == "cpu" else tensor.to(device)


def _default_parent() -> str | None:
    # tmpfs when there is one: staging is a memory copy, not a disk write.
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None
