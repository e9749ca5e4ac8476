"""The /metrics endpoint and the build-info metric."""

from __future__ import annotations

import platform
import threading
from wsgiref.simple_server import WSGIServer

import grpc
from prometheus_client import CollectorRegistry, Info, start_http_server

__all__ = ["MetricsEndpoint", "register_build_info"]


def register_build_info(registry: CollectorRegistry, version: str) -> None:
    """`mmcache_build_info{version, python, grpc} 1`."""
    Info("mmcache_build", "Build of the running mmcache server.", registry=registry).info(
        {"version": version, "python": platform.python_version(), "grpcio": grpc.__version__}
    )


class MetricsEndpoint:
    """Serves `registry` at http://host:port/metrics from a background thread."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self._server: WSGIServer
        self._thread: threading.Thread
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)

    @property
    def port(self) -> int:
        return int(self._server.server_port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
