"""Prometheus metrics of mmcache. Every collector takes the registry it
registers on, so a server (and every test) builds its own."""

from ._cache import CacheMetrics, StoreGauges
from ._encoder import EncoderBookCollector
from ._exposition import MetricsEndpoint, register_build_info
from ._grpc import GrpcServerMetrics, RequestMetrics
from ._l2 import L2Metrics

__all__ = [
    "CacheMetrics",
    "EncoderBookCollector",
    "GrpcServerMetrics",
    "L2Metrics",
    "MetricsEndpoint",
    "RequestMetrics",
    "StoreGauges",
    "register_build_info",
]
