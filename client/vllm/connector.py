"""mmcache as vLLM's encoder-cache (EC) connector: encoder outputs shared by the fleet.

    vllm serve MODEL --ec-transfer-config '{"ec_connector": "MMCacheECConnector",
        "ec_connector_module_path": "mmcache.client.vllm.connector", "ec_role": "ec_both",
        "ec_connector_extra_config": {"target": "127.0.0.1:50051"}}'

(`mmcache.client.vllm_ec`, the former module path, still loads it.) An engine
that encodes an image uploads the encoder output to its sidecar; any engine
on the fleet that gets the same image later loads it instead of running its
vision encoder (docs/vllm.md, "Encoder outputs").

`MMCacheECConnector` is a facade, as vLLM's own connectors are: vLLM makes
one per role, and each holds the part of its role, `connector_scheduler`
(_ec_scheduler.py: lookups in the mirror, reads staged into files, the step's
loads) or `connector_worker` (_ec_worker.py: uploads of the outputs computed,
loads of the staged files). Each method delegates to its role's part; called
on a connector of the other role it raises `WrongRoleError`. What the parts
send each other: _ec_metadata.py; their counters: _ec_metrics.py.

- **Keys** are vLLM's identifier (the item's `mm_hash`, LoRA-prefixed where
  vLLM prefixes it) scoped by a digest of the model, its revision, config,
  dtype, quantization, processor settings and vLLM's version (_keys.py): two
  models, or one in two dtypes, never share an output.
- **Where**: loads only where the workers share the scheduler's host and vLLM
  runs the connector's load (no multi-node, pipeline parallelism or
  encoder-decoder models); elsewhere outputs are saved only.

Settings, in `ec_connector_extra_config` over the plugin's environment
(_settings.ECSettings): `target` (`MMCACHE_TARGET`), `deadline_s`
(`MMCACHE_DEADLINE_S`, 1.0), `staging_gb` (1.0: the staged bytes at most),
`staging_dir` (/dev/shm), `lookup` (`"mirror"`, or `"sidecar"`: also ask the
sidecar for items its mirror lacks, which reads through its L2 tier: one
round trip per new item). Token, TLS and namespace come from the environment.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorRole,
)
from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorPromMetrics
from vllm.logger import init_logger

from ._ec_metadata import MMCacheECMetadata, WorkerCounts
from ._ec_metrics import ECPromMetrics, MMCacheECStats
from ._ec_scheduler import ECScheduler
from ._ec_worker import ECWorker
from ._keys import ec_scope_of
from ._releases import LEAST_VLLM, require_supported_vllm
from ._settings import ECSettings
from .runtime import process_client

__all__ = [
    "LEAST_VLLM",
    "MMCacheECConnector",
    "MMCacheECMetadata",
    "MMCacheECStats",
    "WrongRoleError",
    "require_supported_vllm",
]

_LOGGER = logging.getLogger(__name__)


class WrongRoleError(RuntimeError):
    """A method of one role called on the connector of the other."""


class MMCacheECConnector(ECConnectorBase):  # type: ignore[misc]
    """vLLM's EC connector on an mmcache sidecar (module docstring)."""

    def __init__(self, vllm_config: Any, role: ECConnectorRole) -> None:
        require_supported_vllm()
        super().__init__(vllm_config=vllm_config, role=role)
        settings = ECSettings.from_extra(vllm_config.ec_transfer_config.ec_connector_extra_config)
        scope = ec_scope_of(vllm_config, settings.sidecar.namespace)
        # Made here, not on first use: a sidecar that refuses this engine fails
        # its start, and no request pays for the connection.
        sync = process_client(settings.sidecar)
        # Loads only where the workers can read this host's files and vLLM
        # runs the connector's load for the model; elsewhere outputs are still saved.
        loads_on = self.is_consumer and _loads_possible(vllm_config)
        self.connector_scheduler: ECScheduler | None = None
        self.connector_worker: ECWorker | None = None
        if role == ECConnectorRole.SCHEDULER:  # one line per engine, in vLLM's log
            init_logger("vllm.mmcache").info(
                "mmcache EC connector: sidecar %s, key scope %s, %s",
                settings.sidecar.target,
                scope,
                "saves and loads" if loads_on else "saves only",
            )
            self.connector_scheduler = ECScheduler(vllm_config, settings, sync, scope, loads_on)
        else:
            self.connector_worker = ECWorker(sync, scope, saves=self.is_producer)

    def _scheduler(self, method: str) -> ECScheduler:
        if self.connector_scheduler is None:
            raise WrongRoleError(f"{method} is the scheduler's; this connector is {self.role}'s")
        return self.connector_scheduler

    def _worker(self, method: str) -> ECWorker:
        if self.connector_worker is None:
            raise WrongRoleError(f"{method} is the worker's; this connector is {self.role}'s")
        return self.connector_worker

    # -- scheduler side ------------------------------------------------------

    def ensure_cache_available(self, request: Any, num_computed_tokens: int) -> bool:
        scheduler = self._scheduler("ensure_cache_available")
        return scheduler.ensure_cache_available(request, num_computed_tokens)

    def has_cache_item(self, identifier: str) -> bool:
        return self._scheduler("has_cache_item").has_cache_item(identifier)

    def take_unavailable_requests(self) -> set[str]:
        return self._scheduler("take_unavailable_requests").take_unavailable_requests()

    def update_state_after_alloc(self, request: Any, index: int) -> None:
        self._scheduler("update_state_after_alloc").update_state_after_alloc(request, index)

    def build_connector_meta(self, scheduler_output: Any) -> MMCacheECMetadata:
        return self._scheduler("build_connector_meta").build_connector_meta(scheduler_output)

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler("request_finished").request_finished(request)

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler("update_connector_output").update_connector_output(connector_output)

    # -- worker side ---------------------------------------------------------

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        worker = self._worker("start_load_caches")
        meta = self._get_connector_metadata()
        assert isinstance(meta, MMCacheECMetadata)
        worker.start_load_caches(meta, encoder_cache)

    def save_caches(
        self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any
    ) -> None:
        self._worker("save_caches").save_caches(encoder_cache, mm_hash)

    def build_connector_worker_meta(self) -> WorkerCounts | None:
        return self._worker("build_connector_worker_meta").build_connector_worker_meta()

    # -- both ----------------------------------------------------------------

    def get_ec_connector_stats(self) -> MMCacheECStats | None:
        if self.connector_scheduler is None:
            return None  # a worker's counts go back in its metadata, from one rank
        return self.connector_scheduler.get_ec_connector_stats()

    def shutdown(self) -> None:
        if self.connector_scheduler is not None:
            self.connector_scheduler.close()

    # -- metrics -------------------------------------------------------------

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
        return ECPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


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
