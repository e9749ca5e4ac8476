"""The /metrics endpoint and the build-info metric."""

from __future__ import annotations

import platform
import socket
import threading
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import grpc
from prometheus_client import CollectorRegistry, Info, make_wsgi_app

__all__ = ["MetricsEndpoint", "register_build_info"]


def register_build_info(registry: CollectorRegistry, version: str) -> None:
    """`mmcache_build_info{version, python, grpcio} 1`."""
    Info("mmcache_build", "Build of the running mmcache server.", registry=registry).info(
        {"version": version, "python": platform.python_version(), "grpcio": grpc.__version__}
    )


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes every few seconds would flood the log."""


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class MetricsEndpoint:
    """Serves `registry` at http://host:port/metrics from a background thread.

    prometheus_client's own `start_http_server` polls for shutdown every
    0.5 s; this one stops at once, so a server (or a test) shuts down fast.
    """

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM)[0][0]
        server_class = type("_MetricsServer", (_Server,), {"address_family": family})
        self._server: WSGIServer = make_server(
            host, port, make_wsgi_app(registry), server_class, handler_class=_QuietHandler
        )
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="mmcache-metrics",
            daemon=True,
        )
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._server.server_port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
