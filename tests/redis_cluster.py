"""A real Redis Cluster on loopback: three masters (Debian's redis-server),
each its own process, for the L2 tests and bench/nodes.py.

`scripts/install-system-deps.sh` installs redis-server and redis-cli. Each
master gets `maxmemory` and `allkeys-lru`, as docs/l2.md tells operators to
run it, and no persistence (nothing outlives a test).
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

__all__ = ["RedisCluster", "free_port", "needs_redis", "redis_available", "redis_cluster"]


def redis_available() -> bool:
    return shutil.which("redis-server") is not None and shutil.which("redis-cli") is not None


# The mark of a test that runs redis-server: skipped where it is not installed.
needs_redis = pytest.mark.skipif(
    not redis_available(), reason="redis-server is missing: scripts/install-system-deps.sh"
)


def free_port() -> int:
    """A free loopback port whose port + 10000 (the cluster bus) is free too."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port: int = probe.getsockname()[1]
        if port + 10000 > 65535:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


@dataclass
class RedisCluster:
    """Masters on loopback; `url` is what `mmcache serve --l2` takes."""

    directory: Path
    maxmemory_mb: int
    password: str | None = None  # requirepass (and masterauth), when given
    ports: list[int] = field(default_factory=list)
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.ports[0]}"

    def start_node(self, port: int) -> None:
        node_dir = self.directory / str(port)
        node_dir.mkdir(exist_ok=True)
        self.procs[port] = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                str(node_dir / "nodes.conf"),
                "--cluster-node-timeout",
                "2000",
                # Slots of a dead master stay unserved; the others keep serving.
                "--cluster-require-full-coverage",
                "no",
                "--dir",
                str(node_dir),
                "--save",
                "",
                "--appendonly",
                "no",
                "--maxmemory",
                f"{self.maxmemory_mb}mb",
                "--maxmemory-policy",
                "allkeys-lru",
                "--protected-mode",
                "no",
                "--logfile",
                str(node_dir / "redis.log"),
                *(
                    ["--requirepass", self.password, "--masterauth", self.password]
                    if self.password
                    else []
                ),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.wait_pong(port)

    def wait_pong(self, port: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.cli(port, "PING").strip() == "PONG":
                return
            time.sleep(0.02)
        raise RuntimeError(f"redis-server on port {port} did not start (see {self.directory})")

    def cli(self, port: int, *args: str) -> str:
        done = subprocess.run(
            ["redis-cli", "-p", str(port), *self._auth(), *args],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return done.stdout

    def create(self) -> None:
        if len(self.ports) == 1:  # redis-cli creates three masters at least
            self.cli(self.ports[0], "CLUSTER", "ADDSLOTSRANGE", "0", "16383")
            self.wait_ok()
            return
        nodes = [f"127.0.0.1:{port}" for port in self.ports]
        subprocess.run(
            ["redis-cli", *self._auth(), "--cluster", "create", *nodes, "--cluster-replicas", "0"],
            input="yes\n",
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        self.wait_ok()

    def wait_ok(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            live = [p for p in self.ports if p in self.procs]
            if all("cluster_state:ok" in self.cli(p, "CLUSTER", "INFO") for p in live):
                return
            time.sleep(0.05)
        raise RuntimeError("the Redis Cluster did not reach cluster_state:ok")

    def kill(self, port: int) -> None:
        """SIGKILL one master: its slots go unserved, as after a node's crash."""
        proc = self.procs.pop(port)
        proc.kill()
        proc.wait()

    def restart(self, port: int) -> None:
        """Start a killed master again, empty, with its old cluster config."""
        self.start_node(port)
        self.wait_ok()

    def announce(self, port: int, announced: int) -> None:
        """The node at `port` tells clients (CLUSTER SLOTS) to reach it at
        `announced`: a proxy in front of it, say."""
        self.cli(port, "CONFIG", "SET", "cluster-announce-port", str(announced))

    def _auth(self) -> list[str]:
        return ["--no-auth-warning", "-a", self.password] if self.password else []

    def flushall(self) -> None:
        for port in self.procs:
            self.cli(port, "FLUSHALL")

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.procs.clear()


@contextlib.contextmanager
def redis_cluster(
    masters: int = 3, maxmemory_mb: int = 256, password: str | None = None
) -> Iterator[RedisCluster]:
    """A fresh cluster of `masters` masters (one serving every slot, or three
    at least: redis-cli's minimum)."""
    with tempfile.TemporaryDirectory(prefix="mmcache-redis-") as directory:
        cluster = RedisCluster(Path(directory), maxmemory_mb, password)
        try:
            for _ in range(masters):
                port = free_port()
                cluster.ports.append(port)
                cluster.start_node(port)
            cluster.create()
            yield cluster
        finally:
            cluster.stop()
