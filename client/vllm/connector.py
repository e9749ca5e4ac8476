"""mmcache as vLLM's encoder-cache (EC) connector: encoder outputs shared by the fleet.

    vllm serve MODEL --ec-transfer-config '{"ec_connector": "MMCacheECConnector",
        "ec_connector_module_path": "mmcache.client.vllm.connector", "ec_role": "ec_both",
        "ec_connector_extra_config": {"target": "127.0.0.1:50051"}}'

An engine that encodes an image uploads the encoder output to its sidecar;
any engine on the fleet that gets the same image later loads it instead of
running its vision encoder (docs/vllm.md, "Encoder outputs").

- **Scheduler side** (vLLM's engine core). Before scheduling a request,
  `ensure_cache_available` looks its items up in the client's key mirror (no
  round trip). An item the mirror holds is read from the sidecar, in the
  background, into a file of this engine's (`_staging`), and the request waits
  for that read, at most the deadline. `has_cache_item` says "cached" only for
  a staged item: vLLM asserts when a load fails, and a staged file cannot
  fail to load, whatever the sidecar does meanwhile. Every other outcome
  (not in the mirror, evicted meanwhile, the sidecar down or slow, over the
  staging budget) is "not cached": vLLM encodes it.
- **Worker side.** `save_caches` uploads each output the engine computed, in
  the background, unless the sidecar already holds it; `start_load_caches`
  reads the staged files named in the step's metadata.
- **Keys** are vLLM's identifier (the item's `mm_hash`, LoRA-prefixed where
  vLLM prefixes it) scoped by a digest of the model, its revision, config,
  dtype, quantization, processor settings and vLLM's version: two models, or
  one in two dtypes, never share an output.
- **Where**: loads only where the workers share the scheduler's host and vLLM
  runs the connector's load (no multi-node, pipeline parallelism or
  encoder-decoder models); elsewhere outputs are saved only.
- **Metrics** (`mmcache_ec_*`, on vLLM's `/metrics`): outputs encoded, saved,
  loaded and their bytes, and lookups by result; they travel as vLLM's EC
  connector stats.

Settings, in `ec_connector_extra_config` (or the plugin's environment):
`target` (`MMCACHE_TARGET`), `deadline_s` (`MMCACHE_DEADLINE_S`, 1.0),
`staging_gb` (1.0: the staged bytes at most), `staging_dir` (/dev/shm),
`lookup` (`"mirror"`, or `"sidecar"`: also ask the sidecar for items its
mirror lacks, which reads through its L2 tier: one round trip per new item).
Token, TLS and namespace come from the environment as for the plugin.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
    ECConnectorWorkerMetadata,
)
from vllm.distributed.ec_transfer.ec_connector.metrics import (
    ECConnectorPromMetrics,
    ECConnectorStats,
)
from vllm.logger import init_logger

from mmcache._breaker import Breaker
from mmcache._errors import CacheMissError, MMCacheError
from mmcache._items import BatchedField, FieldElem, MMItem

from . import client_for, ec_scope_of
from ._releases import refusal, release_of
from ._staging import Staged, Staging, load_staged, to_host

if TYPE_CHECKING:
    from .._client import MMCacheClient, UpdateResult
    from ._sync import SyncClient

__all__ = ["MMCacheECConnector", "MMCacheECMetadata", "MMCacheECStats"]

_LOGGER = logging.getLogger(__name__)

# The EC connector interface it is written against (vLLM 0.32's), and the
# releases it was tested with.
LEAST_VLLM = (0, 32)
EC_RELEASES = ((0, 32), (0, 33))


def require_supported_vllm(version: str | None = None) -> None:
    """Refuse, at the engine's start and with what to do, a vLLM older than the
    connector's interface (its EC connector base differs, and requests would
    fail) or one it was not tested with (_releases.py)."""
    import vllm

    found = version if version is not None else str(vllm.__version__)
    release = release_of(found)
    if release is not None and release < LEAST_VLLM:
        raise RuntimeError(
            f"mmcache's EC connector needs vLLM {'.'.join(map(str, LEAST_VLLM))} or later; "
            f"this is vLLM {found}. Use the processor-cache plugin alone there "
            "(MMCACHE_TARGET, without --ec-transfer-config), or upgrade vLLM."
        )
    why = refusal("mmcache's EC connector", found, EC_RELEASES, os.environ)
    if why is not None:
        raise RuntimeError(why)


FIELD = "encoder_output"  # the one field of a stored encoder output
MODALITY = "encoder_output"  # its label on the sidecar's metrics, apart from processed items
_RETRY_S = 5.0  # an item whose read failed is not tried again sooner
_IDLE_TTL_S = 30.0  # a staged item no request took is removed after this
_STUCK_TTL_S = 300.0  # and one whose load never came back, after this
_MAX_UPLOADS = 32  # uploads in flight at most; past it an output is not saved

# Counter names, as ECConnectorStats data keys and metric names (mmcache_ec_*).
_COUNTERS = {
    "encoded": "Encoder outputs this engine computed (vLLM hands each to the connector).",
    "saved": "Encoder outputs uploaded to the sidecar.",
    "saved_bytes": "Bytes of encoder outputs uploaded to the sidecar.",
    "save_skipped": "Encoder outputs not uploaded: the sidecar already held them.",
    "save_failed": "Encoder outputs whose upload failed or was dropped (too many in flight).",
    "loaded": "Encoder outputs loaded into the engine instead of encoding them.",
    "loaded_bytes": "Bytes of encoder outputs loaded into the engine.",
}
# Lookup results: staged (cached for vLLM), or why an item is encoded instead.
_LOOKUPS = (
    "staged",
    "absent",
    "evicted",
    "unavailable",
    "over_budget",
    "staging_error",
    "mismatch",
)


@dataclass
class _Load:
    identifier: str
    token: int  # which staging of it: a late report never counts for a later one
    path: str
    dtype: str
    shape: tuple[int, ...]


@dataclass
class MMCacheECMetadata(ECConnectorMetadata):  # type: ignore[misc]
    """One step's loads: the staged files the workers read."""

    loads: list[_Load] = field(default_factory=list)


@dataclass
class _WorkerCounts(ECConnectorWorkerMetadata):  # type: ignore[misc]
    """A worker's counters since its last step, and the loads the step ran,
    sent back to the scheduler."""

    counts: dict[str, int] = field(default_factory=dict)
    loads_run: list[tuple[str, int]] = field(default_factory=list)  # (identifier, token)

    def aggregate(self, other: ECConnectorWorkerMetadata) -> ECConnectorWorkerMetadata:
        # Tensor-parallel workers each load and encode the same items: the
        # first rank's counts are the engine's.
        return self


@dataclass
class MMCacheECStats(ECConnectorStats):  # type: ignore[misc]
    """Counters of one interval, summed over the engine's steps."""

    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: ECConnectorStats) -> ECConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class _Counts:
    """Counters bumped from the engine's and the client's threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def add(self, name: str, value: int = 1) -> None:
        self.merge({name: value})

    def merge(self, counts: dict[str, int]) -> None:
        with self._lock:
            for name, value in counts.items():
                self._counts[name] = self._counts.get(name, 0) + value

    def take(self) -> dict[str, int]:
        with self._lock:
            counts, self._counts = self._counts, {}
        return counts


class _Settings:
    def __init__(self, extra: dict[str, Any]) -> None:
        target = extra.get("target") or os.environ.get("MMCACHE_TARGET")
        if not target:
            raise ValueError(
                "MMCacheECConnector needs the sidecar: set ec_connector_extra_config "
                '{"target": "host:port"} or MMCACHE_TARGET'
            )
        self.target = str(target)
        self.deadline_s = float(extra.get("deadline_s", os.environ.get("MMCACHE_DEADLINE_S", 1.0)))
        self.staging_bytes = int(float(extra.get("staging_gb", 1.0)) * (1 << 30))
        self.staging_dir = extra.get("staging_dir")
        self.lookup = str(extra.get("lookup", "mirror"))
        if self.lookup not in ("mirror", "sidecar"):
            raise ValueError(f'lookup is "mirror" or "sidecar", not {self.lookup!r}')


class MMCacheECConnector(ECConnectorBase):  # type: ignore[misc]
    """vLLM's EC connector on an mmcache sidecar (module docstring)."""

    def __init__(self, vllm_config: Any, role: ECConnectorRole) -> None:
        require_supported_vllm()
        super().__init__(vllm_config=vllm_config, role=role)
        settings = _Settings(dict(vllm_config.ec_transfer_config.ec_connector_extra_config))
        self._settings = settings
        self._scope = ec_scope_of(vllm_config)
        self._counts = _Counts()
        # Made here, not on first use: a sidecar that refuses this engine fails
        # its start, and no request pays for the connection.
        self._sync: SyncClient = client_for(settings.target, settings.deadline_s)
        # Loads only where the workers can read this host's files and vLLM
        # runs the connector's load for the model; elsewhere outputs are still saved.
        self._loads_on = self.is_consumer and _loads_possible(vllm_config)
        if role == ECConnectorRole.SCHEDULER:  # one line per engine, in vLLM's log
            init_logger("vllm.mmcache").info(
                "mmcache EC connector: sidecar %s, key scope %s, %s",
                settings.target,
                self._scope,
                "saves and loads" if self._loads_on else "saves only",
            )
        if role == ECConnectorRole.SCHEDULER:
            self._ec_config = vllm_config.ec_transfer_config
            self._staging = Staging(settings.staging_bytes, settings.staging_dir)
            self._reads: dict[str, tuple[Future[torch.Tensor], float]] = {}
            # identifier -> when and why its read failed: not tried again sooner
            # than _RETRY_S.
            self._failed: dict[str, tuple[float, str]] = {}
            # The sidecar as a whole: a read it failed to answer opens this, and
            # no read is tried until a probe (the next read, after a backoff
            # doubling from 0.25 s to 2 s) finds it answering again.
            self._sidecar = Breaker()
            self._probe_at = 0.0  # when the next probe may go (inf: one is out)
            self._swept = 0.0
            # Per live request, the items already looked up (one lookup each)
            # and those refused for it (a staged output of another size).
            self._decided: dict[str, set[str]] = {}
            self._refused: dict[str, set[str]] = {}
            self._refused_now: set[str] = set()  # the request being scheduled's
            self._loads: list[_Load] = []
            # What vLLM's own encoder cache likely holds (it evicts silently): an
            # item there needs no read. Wrong either way costs work, never a request.
            self._local: OrderedDict[str, int] = OrderedDict()
            self._local_embeds = 0
            self._local_capacity = int(
                getattr(vllm_config.scheduler_config, "encoder_cache_size", 0) or 0
            )
        else:
            self._loads_run: list[tuple[str, int]] = []
            self._uploads = 0
            self._uploads_lock = threading.Lock()

    def _key(self, identifier: str) -> str:
        return f"{self._scope}:{identifier}"

    # -- scheduler side ----------------------------------------------------

    def ensure_cache_available(self, request: Any, num_computed_tokens: int) -> bool:
        """Start reading the request's items the sidecar holds; False (wait)
        while a read is under way, at most the deadline."""
        # vLLM asks has_cache_item about this request's items right after this.
        request_id = request.request_id
        self._refused_now = self._refused.get(request_id, set())
        if not self._loads_on:
            return True
        decided = self._decided.setdefault(request_id, set())
        waiting = False
        now = time.monotonic()
        for index, feature in enumerate(request.mm_features):
            identifier = feature.identifier
            position = feature.mm_position
            if identifier in decided or position.offset + position.length <= num_computed_tokens:
                continue  # decided for this request, or in its KV cache already
            embeds = request.get_num_encoder_embeds(index)
            staged = self._staging.get(identifier)
            if staged is not None:
                decided.add(identifier)
                if staged.shape[0] == embeds:
                    staged.requests.add(request_id)  # kept for it until it ends
                else:  # the same identifier for other content (a reused uuid)
                    self._refuse(request_id, identifier)
                continue
            if identifier in self._local:
                decided.add(identifier)
                continue
            read = self._reads.get(identifier)
            if read is None:
                if self._worth_reading(identifier, now):
                    future = self._sync.submit(self._read(self._key(identifier)))
                    self._reads[identifier] = (future, now)
                    waiting = True
                else:
                    decided.add(identifier)
                continue
            future, started = read
            if future.done():
                del self._reads[identifier]
                decided.add(identifier)
                staged = self._settle(identifier, future, embeds, feature.modality)
                if staged is not None:
                    staged.requests.add(request_id)
                    # A read leaves the sidecar's LRU order alone: an output the
                    # fleet keeps loading is kept from eviction this way.
                    self._sync.submit(self._sync.client.refresh([self._key(identifier)]))
            elif now - started > self._settings.deadline_s:
                del self._reads[identifier]
                future.cancel()
                self._unanswered("no answer within the deadline", now)
                self._fail(identifier, "unavailable", now)
                decided.add(identifier)
            else:
                waiting = True
        return not waiting

    def _refuse(self, request_id: str, identifier: str) -> None:
        self._refused.setdefault(request_id, set()).add(identifier)
        self._refused_now = self._refused[request_id]
        self._counts.add("lookup_mismatch")

    def _worth_reading(self, identifier: str, now: float) -> bool:
        if self._sidecar.is_open:
            if now < self._probe_at:  # down: vLLM encodes, with no wait
                self._counts.add("lookup_unavailable")
                return False
            self._probe_at = float("inf")  # this read is the probe
        failed = self._failed.get(identifier)
        if failed is not None:
            when, why = failed
            if now - when < _RETRY_S:
                self._counts.add(f"lookup_{why}")
                return False
            del self._failed[identifier]
        client = self._sync.client
        if client.is_cached([self._key(identifier)])[0]:
            return True
        if self._settings.lookup == "sidecar" and client.following:
            return True
        self._counts.add("lookup_absent")
        return False

    async def _read(self, key: str) -> torch.Tensor:
        client = self._sync.client
        async with asyncio.timeout(self._settings.deadline_s):
            # No wait for a sidecar that is unreachable: the engine encodes instead.
            (item,) = await client.fetch([key], release=False, wait=False)
        data = item[FIELD]
        tensor = data.data if isinstance(data, FieldElem) else data
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{key} holds no encoder output")
        return tensor

    def _settle(
        self, identifier: str, future: Future[torch.Tensor], embeds: int, modality: str
    ) -> Staged | None:
        """Stage a finished read's output; None (and why, counted) when not."""
        now = time.monotonic()
        try:
            tensor = future.result()
        except CacheMissError:  # in the mirror, gone on the sidecar; or never there
            self._answered()
            why = "evicted" if self._settings.lookup == "mirror" else "absent"
            self._fail(identifier, why, now)
            return None
        except (MMCacheError, TimeoutError, OSError) as exc:
            _LOGGER.debug("mmcache: reading encoder output %s failed: %s", identifier, exc)
            self._unanswered(str(exc) or type(exc).__name__, now)
            self._fail(identifier, "unavailable", now)
            return None
        except Exception:  # a bad item: never the engine's failure
            self._answered()
            _LOGGER.warning("mmcache: encoder output %s unreadable", identifier, exc_info=True)
            self._fail(identifier, "mismatch", now)
            return None
        self._answered()
        if not self._fits(tensor, embeds, modality):
            self._fail(identifier, "mismatch", now)
            return None
        try:
            staged = self._staging.put(identifier, tensor)
        except OSError as exc:  # a full staging_dir: encode instead
            directory = self._staging.directory
            _LOGGER.warning("mmcache: cannot stage encoder outputs in %s: %s", directory, exc)
            self._fail(identifier, "staging_error", now)
            return None
        if staged is None:
            self._fail(identifier, "over_budget", now)
            return None
        self._counts.add("lookup_staged")
        return staged

    def _answered(self) -> None:
        if self._sidecar.is_open:
            down_s = self._sidecar.reset()
            _LOGGER.info("mmcache: the sidecar answers again (reads skipped %.1f s)", down_s)

    def _unanswered(self, reason: str, now: float) -> None:
        if self._sidecar.trip(reason):
            _LOGGER.warning("mmcache: the sidecar did not answer a read (%s): vLLM encodes", reason)
        else:
            self._sidecar.probe_failed(reason)
        self._probe_at = now + self._sidecar.backoff_s

    def _fits(self, tensor: torch.Tensor, embeds: int, modality: str) -> bool:
        """The output has the request's rows, and the width the engine measured
        for the modality (when it did)."""
        if tensor.dim() != 2 or tensor.shape[0] != embeds:
            return False
        width = self._ec_config.mm_encoder_output_widths.get(modality)
        return width is None or tensor.shape[1] == width

    def _fail(self, identifier: str, why: str, now: float) -> None:
        self._failed[identifier] = (now, why)
        self._counts.add(f"lookup_{why}")

    def has_cache_item(self, identifier: str) -> bool:
        """Cached only when staged for this engine: its load cannot fail."""
        return (
            self._loads_on and identifier in self._staging and identifier not in self._refused_now
        )

    def take_unavailable_requests(self) -> set[str]:
        """None, ever: an output this connector cannot read is encoded by the
        engine instead (every request has its input), and a load is promised
        (`has_cache_item`) only once its output is staged on this host."""
        return set()

    def update_state_after_alloc(self, request: Any, index: int) -> None:
        feature = request.mm_features[index]
        identifier = feature.identifier
        self._remember_local(identifier, request.get_num_encoder_embeds(index))
        staged = self._staging.get(identifier)
        if staged is None:
            return  # vLLM encodes it
        staged.requests.add(request.request_id)
        if all(load.identifier != identifier for load in self._loads):
            staged.handed = True
            staged.loads_in_flight += 1
            self._loads.append(
                _Load(identifier, staged.token, staged.path, staged.dtype, staged.shape)
            )

    def _remember_local(self, identifier: str, embeds: int) -> None:
        local = self._local
        if identifier in local:
            local.move_to_end(identifier)
            return
        local[identifier] = embeds
        self._local_embeds += embeds
        while self._local_embeds > self._local_capacity and local:
            _, dropped = local.popitem(last=False)
            self._local_embeds -= dropped

    def build_connector_meta(self, scheduler_output: Any) -> MMCacheECMetadata:
        meta = MMCacheECMetadata(self._loads)
        self._loads = []
        now = time.monotonic()
        for identifier, staged in self._staging.items():
            if staged.requests:
                continue
            idle = now - staged.idle_since
            # A file goes once no request holds it and no step that names it
            # is still to run (an aborted request ends while a step built
            # before may yet load it); one that no request took, after a
            # while; one whose step never came back (stopped), after longer.
            settled = staged.loads_in_flight == 0 and (staged.handed or idle > _IDLE_TTL_S)
            if settled or idle > _STUCK_TTL_S:
                self._staging.drop(identifier)
        if now - self._swept > 1.0:
            self._sweep(now)
        return meta

    def _sweep(self, now: float) -> None:
        """Forget failures past their retry time, and reads no request came
        back for (aborted while waiting)."""
        self._swept = now
        self._failed = {i: f for i, f in self._failed.items() if now - f[0] < _RETRY_S}
        for identifier, (future, started) in list(self._reads.items()):
            if now - started > 2 * self._settings.deadline_s:
                future.cancel()
                del self._reads[identifier]

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        self._decided.pop(request.request_id, None)
        self._refused.pop(request.request_id, None)
        for feature in request.mm_features or ():
            staged = self._staging.get(feature.identifier)
            if staged is not None and request.request_id in staged.requests:
                staged.requests.discard(request.request_id)
                if not staged.requests:
                    staged.idle_since = time.monotonic()
                    if staged.loads_in_flight == 0:  # loaded: in vLLM's cache now
                        self._staging.drop(feature.identifier)
        return False, None

    def update_connector_output(self, connector_output: Any) -> None:
        meta = connector_output.ec_connector_worker_meta
        if not isinstance(meta, _WorkerCounts):
            return
        self._counts.merge(meta.counts)
        for identifier, token in meta.loads_run:
            staged = self._staging.get(identifier)
            if staged is not None and staged.token == token:
                staged.loads_in_flight -= 1

    def get_ec_connector_stats(self) -> MMCacheECStats | None:
        if self.role != ECConnectorRole.SCHEDULER:
            return None  # a worker's counts go back in its metadata, from one rank
        counts = self._counts.take()
        return MMCacheECStats(data=counts) if counts else None

    def shutdown(self) -> None:
        if self.role == ECConnectorRole.SCHEDULER:
            for future, _ in self._reads.values():
                future.cancel()
            self._staging.close()

    # -- worker side -------------------------------------------------------

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, MMCacheECMetadata)
        device = _device()
        for load in meta.loads:
            self._loads_run.append((load.identifier, load.token))
            if load.identifier in encoder_cache:
                continue
            tensor = load_staged(load.path, load.dtype, load.shape, device)
            encoder_cache[load.identifier] = tensor
            self._counts.add("loaded")
            self._counts.add("loaded_bytes", tensor.nbytes)

    def save_caches(
        self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any
    ) -> None:
        self._counts.add("encoded")
        if not self.is_producer or not _first_rank():
            return  # tensor-parallel ranks hold the same output: one uploads it
        key = self._key(mm_hash)
        client = self._sync.client
        if client.is_cached([key])[0]:
            self._counts.add("save_skipped")
            return
        with self._uploads_lock:
            if self._uploads >= _MAX_UPLOADS:
                self._counts.add("save_failed")
                return
            self._uploads += 1
        # A copy of the engine's own: the upload runs after this step goes on.
        # On a GPU it is queued behind the encoder's work, and the upload waits
        # for it on a thread of its own: the engine's thread never does.
        data, copied = to_host(encoder_cache[mm_hash])
        item = MMItem.from_elems([FieldElem(MODALITY, FIELD, data, BatchedField())])
        future = self._sync.submit(self._upload(client, item, key, copied))
        future.add_done_callback(lambda done: self._uploaded(done, data.nbytes))

    @staticmethod
    async def _upload(
        client: MMCacheClient, item: MMItem, key: str, copied: Callable[[], None] | None
    ) -> UpdateResult:
        if copied is not None:  # a GPU's copy, still queued
            await asyncio.to_thread(copied)
        return await client.get_and_update([item], [key], lease=False)

    def _uploaded(self, future: Future[Any], nbytes: int) -> None:
        with self._uploads_lock:
            self._uploads -= 1
        try:
            held = bool(future.result().held[0])
        except (CancelledError, Exception):  # the upload failed or was cancelled
            held = False
        if held:
            self._counts.add("saved")
            self._counts.add("saved_bytes", nbytes)
        else:
            self._counts.add("save_failed")

    def build_connector_worker_meta(self) -> _WorkerCounts | None:
        counts = self._counts.take()
        loads_run, self._loads_run = self._loads_run, []
        return _WorkerCounts(counts, loads_run) if counts or loads_run else None

    # -- metrics -----------------------------------------------------------

    @classmethod
    def build_ec_connector_stats(cls, data: dict[str, Any] | None = None) -> MMCacheECStats:
        return MMCacheECStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> ECConnectorPromMetrics:
        return _PromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


class _PromMetrics(ECConnectorPromMetrics):  # type: ignore[misc]
    """`mmcache_ec_*` on vLLM's /metrics, one child per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for name, documentation in _COUNTERS.items():
            counter = self._counter_cls(
                name=f"mmcache_ec_{name}", documentation=documentation, labelnames=labelnames
            )
            self._counters[name] = {
                engine: counter.labels(*values) for engine, values in per_engine_labelvalues.items()
            }
        lookups = self._counter_cls(
            name="mmcache_ec_lookups",
            documentation="Items the scheduler looked up, by result: staged (ready to load), "
            "or why vLLM encodes it (absent, evicted, unavailable, over_budget, staging_error, "
            "mismatch).",
            labelnames=[*labelnames, "result"],
        )
        for result in _LOOKUPS:
            self._counters[f"lookup_{result}"] = {
                engine: lookups.labels(*values, result)
                for engine, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            children = self._counters.get(name)
            if children is not None and value:
                children[engine_idx].inc(value)


def _loads_possible(vllm_config: Any) -> bool:
    """Whether loads can be promised: the workers read files of the scheduler's
    host, and vLLM runs the connector's load for this model."""
    parallel = vllm_config.parallel_config
    reasons = []
    if getattr(parallel, "nnodes", 1) > 1 or parallel.distributed_executor_backend == "ray":
        reasons.append("workers on other nodes cannot read this node's staged files")
    if parallel.pipeline_parallel_size > 1:
        reasons.append("vLLM drops the connector's output under pipeline parallelism")
    if vllm_config.model_config.is_encoder_decoder:
        reasons.append("vLLM never runs the connector's load for encoder-decoder models")
    for reason in reasons:
        _LOGGER.warning("mmcache EC connector: no loads, outputs only saved: %s", reason)
    return not reasons


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
