"""The plugin's own counters, on vLLM's /metrics.

vLLM serves prometheus_client's global registry on its /metrics (summed over
its API processes), so the counters go where vLLM's operators look. Made
once per process, on first use: a second client (the EC connector's) shares
them. What they tell: how often the sidecar failed open, and what a hit
saves against what an upload costs, in CPU seconds of the API processes
(the processor's CPU on the items they processed; the CPU of the uploads
they sent), and what was not shared (client/vllm/_costs.py, `Uploads`),
or kept in its process by design (client/vllm/_small.py).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

__all__ = ["PluginMetrics", "plugin_metrics", "serve_metrics"]

_LOGGER = logging.getLogger(__name__)


@dataclass(frozen=True)
class PluginMetrics:
    fail_opens: Any
    processed: Any
    processing_cpu: Any
    uploaded: Any
    upload_cpu: Any
    not_uploaded: Any
    kept_small: Any
    small_paused: Any


_lock = threading.Lock()
_made: PluginMetrics | None = None


def plugin_metrics() -> PluginMetrics:
    global _made
    from prometheus_client import REGISTRY, Counter

    with _lock:
        if _made is None:
            _made = PluginMetrics(
                Counter(
                    "mmcache_vllm_fail_opens",
                    "Calls to the mmcache sidecar that failed open: the items went inline.",
                    registry=REGISTRY,
                ),
                Counter(
                    "mmcache_vllm_processed_items",
                    "Items an API process ran vLLM's processor on (its misses).",
                    registry=REGISTRY,
                ),
                Counter(
                    "mmcache_vllm_processing_cpu_seconds",
                    "CPU seconds of vLLM's processor on those items: what hits save.",
                    registry=REGISTRY,
                ),
                Counter(
                    "mmcache_vllm_uploaded_items",
                    "Processed items uploaded to the sidecar, for other requests to hit.",
                    registry=REGISTRY,
                ),
                Counter(
                    "mmcache_vllm_upload_cpu_seconds",
                    "CPU seconds the uploads cost the API processes.",
                    registry=REGISTRY,
                ),
                Counter(
                    "mmcache_vllm_not_uploaded_items",
                    "Items not shared: larger than the sidecar, uploads backed up, or failed.",
                    registry=REGISTRY,
                ),
                Counter(
                    "mmcache_vllm_kept_small_items",
                    "Small images processed and not uploaded, kept in their API process as "
                    "vLLM alone keeps them: one API server, no shared memory or out of touch, "
                    "or the sidecar held them already, or paused their sharing (docs/vllm.md).",
                    registry=REGISTRY,
                ),
                Counter(
                    "mmcache_vllm_small_paused_items",
                    "Of those, small images not shared because the sidecar paused the sharing "
                    "of small items, which were seldom asked for again "
                    "(mmcache_small_sharing_paused; one in 8 is shared all the same).",
                    registry=REGISTRY,
                ),
            )
        return _made


def serve_metrics(port: int) -> bool:
    """prometheus_client's registry (the plugin's counters) on `port`, from
    this process: for one that serves no /metrics of its own (NVIDIA Dynamo's
    frontend and workers; `vllm serve` has its own). False, with a WARNING,
    when the port is taken (another process of the deployment serves it)."""
    from prometheus_client import start_http_server

    plugin_metrics()  # the counters exist before the first scrape
    try:
        start_http_server(port)
    except OSError as exc:
        _LOGGER.warning(
            "mmcache: the plugin's counters are not served on port %d "
            "(MMCACHE_VLLM_METRICS_PORT): %s; another process of this deployment may "
            "serve them there",
            port,
            exc,
        )
        return False
    return True
