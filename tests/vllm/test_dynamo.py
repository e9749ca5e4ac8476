"""The Dynamo-style flow of docs/vllm.md, run as its example is written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import Sidecar
from .serve import sidecar_metrics
from .test_engine import ENGINE_ENV, ROOT, model  # noqa: F401  (a fixture)

EXAMPLE = ROOT / "docs" / "examples" / "dynamo_flow.py"

# It runs vLLM's engine in process (left out where vLLM has no CPU build).
pytestmark = pytest.mark.engine


def test_frontend_uploads_worker_fetches_and_injects_with_vllms_counters_right(
    model: Path,  # noqa: F811
    sidecar: Sidecar,
) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), str(model), sidecar.target],
        cwd=ROOT,
        env={**os.environ, **ENGINE_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, done.stderr[-3000:]
    seen = json.loads(lines[-1])
    assert seen["held"] == [True, True] and seen["fetched_equal"] is True
    # Two items injected (queries, not hits), then one new image chatted about.
    assert seen["vllm"] == {"vllm:mm_cache_queries": 3, "vllm:mm_cache_hits": 0}
    served = sidecar_metrics(sidecar.metrics_port)
    assert served["mmcache_leases"] == 0  # the worker's read released the frontend's leases
    assert served["mmcache_sent_bytes_total"] == served["mmcache_received_bytes_total"] > 0
