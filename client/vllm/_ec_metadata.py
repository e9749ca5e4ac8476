"""What the EC connector's scheduler part and worker parts send each other.

The scheduler sends a step's loads (`MMCacheECMetadata`: the staged files the
workers read); a worker sends back its counters and the loads the step ran
(`WorkerCounts`). Both travel inside vLLM's scheduler and model-runner outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorMetadata,
    ECConnectorWorkerMetadata,
)

__all__ = ["FIELD", "MODALITY", "Load", "MMCacheECMetadata", "WorkerCounts"]

FIELD = "encoder_output"  # the one field of a stored encoder output
MODALITY = "encoder_output"  # its label on the sidecar's metrics, apart from processed items


@dataclass
class Load:
    identifier: str
    token: int  # which staging of it: a late report never counts for a later one
    path: str
    dtype: str
    shape: tuple[int, ...]


@dataclass
class MMCacheECMetadata(ECConnectorMetadata):  # type: ignore[misc]
    """One step's loads: the staged files the workers read."""

    loads: list[Load] = field(default_factory=list)


@dataclass
class WorkerCounts(ECConnectorWorkerMetadata):  # type: ignore[misc]
    """A worker's counters since its last step, and the loads the step ran,
    sent back to the scheduler."""

    counts: dict[str, int] = field(default_factory=dict)
    loads_run: list[tuple[str, int]] = field(default_factory=list)  # (identifier, token)

    def aggregate(self, other: ECConnectorWorkerMetadata) -> ECConnectorWorkerMetadata:
        # Tensor-parallel workers each load and encode the same items: the
        # first rank's counts are the engine's.
        return self
