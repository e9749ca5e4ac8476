"""The EC connector's worker part (each model runner): saves and loads.

`save_caches` (vLLM calls it for every output the engine computes) uploads
the output in the background unless the sidecar already holds it: at most
`MAX_UPLOADS` in flight (runtime.BackgroundCalls), tensor-parallel rank 0 only. On a GPU the copy to
the host is queued behind the encoder's work and the upload waits for it on
a thread of its own (_staging.to_host): the engine's thread never does.
`start_load_caches` reads the staged files the step's metadata names
(_staging.load_staged). Its counters go back to the scheduler with each step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from mmcache._items import BatchedField, FieldElem, MMItem

from ._ec_metadata import FIELD, MODALITY, MMCacheECMetadata, WorkerCounts
from ._ec_metrics import Counts
from ._keys import scoped_key
from ._staging import load_staged, to_host

if TYPE_CHECKING:
    from mmcache.client import MMCacheClient

    from .runtime import SyncClient

__all__ = ["MAX_UPLOADS", "ECWorker"]

MAX_UPLOADS = 32  # uploads in flight at most; past it an output is not saved


class ECWorker:
    """One model runner's part of the connector.

    `saves`: this engine's role produces outputs (vLLM's `is_producer`)."""

    def __init__(self, sync: SyncClient, scope: str, *, saves: bool) -> None:
        self._sync = sync
        self._scope = scope
        self._saves = saves
        self._counts = Counts()
        self._loads_run: list[tuple[str, int]] = []
        self._uploads = sync.background(MAX_UPLOADS)

    def start_load_caches(
        self, meta: MMCacheECMetadata, encoder_cache: dict[str, torch.Tensor]
    ) -> None:
        device = _device()
        for load in meta.loads:
            self._loads_run.append((load.identifier, load.token))
            if load.identifier in encoder_cache:
                continue
            tensor = load_staged(load.path, load.dtype, load.shape, device)
            encoder_cache[load.identifier] = tensor
            self._counts.add("loaded")
            self._counts.add("loaded_bytes", tensor.nbytes)

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str) -> None:
        self._counts.add("encoded")
        if not self._saves or not _first_rank():
            return  # tensor-parallel ranks hold the same output: one uploads it
        key = scoped_key(self._scope, mm_hash)
        client = self._sync.client
        if client.is_cached([key])[0]:
            self._counts.add("save_skipped")
            return
        tensor = encoder_cache[mm_hash]

        def upload() -> Coroutine[Any, Any, bool]:
            # A copy of the engine's own: the upload runs after this step goes on.
            # On a GPU it is queued behind the encoder's work, and the upload waits
            # for it on a thread of its own: the engine's thread never does.
            data, copied = to_host(tensor)
            item = MMItem.from_elems([FieldElem(MODALITY, FIELD, data, BatchedField())])
            return _upload(client, item, key, copied)

        # Its size, not the tensor: the engine's GPU memory is not held while the upload runs.
        nbytes = tensor.nbytes
        if not self._uploads.start(upload, lambda done: self._uploaded(done, nbytes)):
            self._counts.add("save_failed")

    def _uploaded(self, future: Future[bool], nbytes: int) -> None:
        # Not held: the upload failed (logged by the runtime) or was cancelled.
        if not future.cancelled() and future.exception() is None and future.result():
            self._counts.add("saved")
            self._counts.add("saved_bytes", nbytes)
        else:
            self._counts.add("save_failed")

    def build_connector_worker_meta(self) -> WorkerCounts | None:
        counts = self._counts.take()
        loads_run, self._loads_run = self._loads_run, []
        return WorkerCounts(counts, loads_run) if counts or loads_run else None


async def _upload(
    client: MMCacheClient, item: MMItem, key: str, copied: Callable[[], None] | None
) -> bool:
    """Whether the sidecar holds the output once uploaded."""
    if copied is not None:  # a GPU's copy, still queued
        await asyncio.to_thread(copied)
    result = await client.get_and_update([item], [key], lease=False)
    return bool(result.held[0])


def _first_rank() -> bool:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    try:
        return int(get_tensor_model_parallel_rank()) == 0
    except AssertionError:  # no tensor-parallel group: one worker
        return True


def _device() -> str:
    from vllm.platforms import current_platform

    # No device (vLLM's UnspecifiedPlatform, a build with no backend here): the CPU.
    device = str(current_platform.device_type) or "cpu"
    if current_platform.is_cuda_alike():
        device = f"{device}:{current_platform.current_device()}"
    return device
