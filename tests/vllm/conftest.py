"""The vLLM plugin's tests: a real mmcache server process, vLLM's real types.

They run in the vLLM environment (scripts/vllm-env.sh; `make test-vllm`),
never in the main one, whose pytest does not collect this folder.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

MMCACHE = str(Path(sys.executable).with_name("mmcache"))


def pytest_configure(config: pytest.Config) -> None:
    """The tests' images are 100x80: small, so the plugin would keep each in
    the API process that processed it (client/vllm/_small.py). These tests
    are about what is shared, so everything is, in every vLLM they start;
    the rule's own tests turn it back on (test_caches.py, test_engine.py).
    (A hook, not an import-time setting: the benches import this module.)"""
    os.environ.setdefault("MMCACHE_SHARE_SMALL", "on")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Sidecar:
    """`mmcache serve` in a process of its own, restartable on the same port."""

    def __init__(self, capacity_gb: float = 0.25, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.metrics_port = free_port()
        self.health_port = free_port()  # plaintext, so probes work whatever TLS says
        self.env = env or {}
        self.target = f"127.0.0.1:{self.port}"
        self.capacity_gb = capacity_gb
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, "MMCACHE_LOG_LEVEL": "WARNING", **self.env}
        self.proc = subprocess.Popen(
            [
                *(MMCACHE, "serve", "--host", "127.0.0.1", "--port", str(self.port)),
                *("--metrics-port", str(self.metrics_port)),
                *("--health-port", str(self.health_port)),
                *("--capacity-gb", str(self.capacity_gb), "--grace-s", "0"),
            ],
            env=env,
        )
        deadline = time.monotonic() + 30
        probe = [MMCACHE, "health", f"127.0.0.1:{self.health_port}"]
        try:
            while subprocess.run(probe, check=False, capture_output=True).returncode != 0:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("the mmcache sidecar did not start")
                time.sleep(0.1)
        except BaseException:  # (a signal too): no sidecar left running
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None

    def kill(self) -> None:
        """SIGKILL: gone at once, with no goodbye to its clients."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None


@contextlib.contextmanager
def sidecars(count: int, env: dict[str, str] | None = None) -> Iterator[list[Sidecar]]:
    """`count` sidecars started (each with `env`), stopped at the end."""
    started: list[Sidecar] = []
    try:
        for _ in range(count):
            started.append(Sidecar(env=env))
            started[-1].start()
        yield started
    finally:
        for node in started:
            node.stop()


@pytest.fixture
def sidecar() -> Iterator[Sidecar]:
    server = Sidecar()
    server.start()
    try:
        yield server
    finally:
        server.stop()
