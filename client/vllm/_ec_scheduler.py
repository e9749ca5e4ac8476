"""The EC connector's scheduler part (vLLM's engine core): lookups and staging.

Before a request is scheduled, `ensure_cache_available` looks its items up in
the client's key mirror (no round trip). An item the mirror holds is read
from the sidecar, in the background, into a file of this engine's
(_staging.py), and the request waits for that read, at most the deadline.
`has_cache_item` says "cached" only for a staged item: vLLM asserts when a
load fails, and a staged file cannot fail to load, whatever the sidecar does
meanwhile. Every other outcome (not in the mirror, evicted meanwhile, the
sidecar down or slow, over the staging budget, an output of another shape)
is "not cached": vLLM encodes it. A read the sidecar did not answer opens a
breaker: no read is tried until a probe finds it answering again.

Staged files go once no live request holds them and every step that named
them has come back from the workers (`build_connector_meta`). Used from the
engine core's one thread; reads finish on the client's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from mmcache._breaker import Breaker
from mmcache._errors import CacheMissError, MMCacheError
from mmcache._items import FieldElem

from ._ec_metadata import FIELD, Load, MMCacheECMetadata, WorkerCounts
from ._ec_metrics import Counts, MMCacheECStats
from ._keys import scoped_key
from ._staging import Staged, Staging

if TYPE_CHECKING:
    from ._settings import ECSettings
    from .runtime import SyncClient

__all__ = ["ECScheduler"]

_LOGGER = logging.getLogger(__name__)

_RETRY_S = 5.0  # an item whose read failed is not tried again sooner
_IDLE_TTL_S = 30.0  # a staged item no request took is removed after this
_STUCK_TTL_S = 300.0  # and one whose load never came back, after this


class ECScheduler:
    """The engine core's part of the connector.

    `loads_on`: loads may be promised (a consumer whose workers read this
    host's files, _loads_possible in connector.py); else every item is
    encoded, and outputs are only saved by the workers."""

    def __init__(
        self, vllm_config: Any, settings: ECSettings, sync: SyncClient, scope: str, loads_on: bool
    ) -> None:
        self._settings = settings
        self._sync = sync
        self._scope = scope
        self._loads_on = loads_on
        self._counts = Counts()
        # Its mm_encoder_output_widths: what the engine measured, read when used.
        self._ec_config = vllm_config.ec_transfer_config
        self.staging = Staging(settings.staging_bytes, settings.staging_dir)
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
        self._loads: list[Load] = []
        # What vLLM's own encoder cache likely holds (it evicts silently): an
        # item there needs no read. Wrong either way costs work, never a request.
        self._local: OrderedDict[str, int] = OrderedDict()
        self._local_embeds = 0
        self._local_capacity = int(
            getattr(vllm_config.scheduler_config, "encoder_cache_size", 0) or 0
        )

    def _key(self, identifier: str) -> str:
        return scoped_key(self._scope, identifier)

    # -- lookups -------------------------------------------------------------

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
            position = feature.mm_position
            if (
                feature.identifier in decided
                or position.offset + position.length <= num_computed_tokens
            ):
                continue  # decided for this request, or in its KV cache already
            if self._look_up(request, index, decided, now):
                waiting = True
        return not waiting

    def _look_up(self, request: Any, index: int, decided: set[str], now: float) -> bool:
        """Decide, or go on deciding, one of the request's items; True while
        its read is under way."""
        feature = request.mm_features[index]
        identifier = feature.identifier
        embeds = request.get_num_encoder_embeds(index)
        staged = self.staging.get(identifier)
        if staged is not None:
            decided.add(identifier)
            if staged.shape[0] == embeds:
                staged.requests.add(request.request_id)  # kept for it until it ends
            else:  # the same identifier for other content (a reused uuid)
                self._refuse(request.request_id, identifier)
            return False
        if identifier in self._local:
            decided.add(identifier)
            return False
        read = self._reads.get(identifier)
        if read is None:
            if not self._worth_reading(identifier, now):
                decided.add(identifier)
                return False
            self._reads[identifier] = (self._sync.submit(self._read(self._key(identifier))), now)
            return True
        future, started = read
        if future.done():
            del self._reads[identifier]
            decided.add(identifier)
            staged = self._settle(identifier, future, embeds, feature.modality)
            if staged is not None:
                staged.requests.add(request.request_id)
                # A read leaves the sidecar's LRU order alone: an output the
                # fleet keeps loading is kept from eviction this way.
                self._sync.submit(self._sync.client.refresh([self._key(identifier)]))
            return False
        if now - started > self._settings.sidecar.deadline_s:
            del self._reads[identifier]
            future.cancel()
            self._unanswered("no answer within the deadline", now)
            self._fail(identifier, "unavailable", now)
            decided.add(identifier)
            return False
        return True

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
        async with asyncio.timeout(self._settings.sidecar.deadline_s):
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
        return self._stage(identifier, tensor, now)

    def _stage(self, identifier: str, tensor: torch.Tensor, now: float) -> Staged | None:
        try:
            staged = self.staging.put(identifier, tensor)
        except OSError as exc:  # a full staging_dir: encode instead
            directory = self.staging.directory
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
        return self._loads_on and identifier in self.staging and identifier not in self._refused_now

    def take_unavailable_requests(self) -> set[str]:
        """None, ever: an output this connector cannot read is encoded by the
        engine instead (every request has its input), and a load is promised
        (`has_cache_item`) only once its output is staged on this host."""
        return set()

    # -- steps -----------------------------------------------------------------

    def update_state_after_alloc(self, request: Any, index: int) -> None:
        feature = request.mm_features[index]
        identifier = feature.identifier
        self._remember_local(identifier, request.get_num_encoder_embeds(index))
        staged = self.staging.get(identifier)
        if staged is None:
            return  # vLLM encodes it
        staged.requests.add(request.request_id)
        if all(load.identifier != identifier for load in self._loads):
            staged.handed = True
            staged.loads_in_flight += 1
            self._loads.append(
                Load(identifier, staged.token, staged.path, staged.dtype, staged.shape)
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
        for identifier, staged in self.staging.items():
            if staged.requests:
                continue
            idle = now - staged.idle_since
            # A file goes once no request holds it and no step that names it
            # is still to run (an aborted request ends while a step built
            # before may yet load it); one that no request took, after a
            # while; one whose step never came back (stopped), after longer.
            settled = staged.loads_in_flight == 0 and (staged.handed or idle > _IDLE_TTL_S)
            if settled or idle > _STUCK_TTL_S:
                self.staging.drop(identifier)
        if now - self._swept > 1.0:
            self._sweep(now)
        return meta

    def _sweep(self, now: float) -> None:
        """Forget failures past their retry time, and reads no request came
        back for (aborted while waiting)."""
        self._swept = now
        self._failed = {i: f for i, f in self._failed.items() if now - f[0] < _RETRY_S}
        for identifier, (future, started) in list(self._reads.items()):
            if now - started > 2 * self._settings.sidecar.deadline_s:
                future.cancel()
                del self._reads[identifier]

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        self._decided.pop(request.request_id, None)
        self._refused.pop(request.request_id, None)
        for feature in request.mm_features or ():
            staged = self.staging.get(feature.identifier)
            if staged is not None and request.request_id in staged.requests:
                staged.requests.discard(request.request_id)
                if not staged.requests:
                    staged.idle_since = time.monotonic()
                    if staged.loads_in_flight == 0:  # loaded: in vLLM's cache now
                        self.staging.drop(feature.identifier)
        return False, None

    def update_connector_output(self, connector_output: Any) -> None:
        meta = connector_output.ec_connector_worker_meta
        if not isinstance(meta, WorkerCounts):
            return
        self._counts.merge(meta.counts)
        for identifier, token in meta.loads_run:
            staged = self.staging.get(identifier)
            if staged is not None and staged.token == token:
                staged.loads_in_flight -= 1

    def get_ec_connector_stats(self) -> MMCacheECStats | None:
        counts = self._counts.take()
        return MMCacheECStats(data=counts) if counts else None

    def close(self) -> None:
        for future, _ in self._reads.values():
            future.cancel()
        self.staging.close()
