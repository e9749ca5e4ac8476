"""Fixtures: a real server on free loopback ports, real gRPC, real /metrics."""

from __future__ import annotations

import asyncio
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mmcache.server import MMCacheServer, ServerConfig, ShmConfig
from mmcache.server.cache import parts_of

if TYPE_CHECKING:
    from mmcache.client import MMCacheClient
    from mmcache.server.cache._region import Region
    from mmcache.server.cache._store import ItemStore

MIB = 1 << 20
T = TypeVar("T")

# The console script installed beside the interpreter running the tests: found
# without relying on an activated virtual environment's PATH.
MMCACHE = str(Path(sys.executable).with_name("mmcache"))


async def eventually(check: Callable[[], bool], timeout: float = 5.0) -> float:
    """Seconds until `check()` holds; fails the test after `timeout`."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not true within {timeout}s")
        await asyncio.sleep(0.002)
    return time.monotonic() - start


async def reaches(read: Callable[[], Awaitable[T]], want: T, timeout: float = 5.0) -> None:
    """Until `await read()` equals `want` (a scrape, say); fails the test with
    the last value read after `timeout`."""
    deadline = time.monotonic() + timeout
    while (got := await read()) != want:
        assert time.monotonic() < deadline, f"{got!r}, not {want!r}, after {timeout}s"
        await asyncio.sleep(0.02)


def store_of(server: MMCacheServer) -> ItemStore:
    """A server's L1 store, for what no call shows."""
    return parts_of(server.cache).store


def region_of(server: MMCacheServer) -> Region | None:
    """A server's shared-memory region, while it runs with one."""
    return parts_of(server.cache).region


def server_config(capacity_bytes: int = 256 * MIB, **overrides: object) -> ServerConfig:
    settings: dict[str, object] = {
        "host": "127.0.0.1",
        "port": 0,
        "metrics_port": 0,
        "capacity_bytes": capacity_bytes,
        "grace_s": 0,
        # gRPC only, as the wire tests expect; tests/test_shm.py turns it on.
        "shm": ShmConfig(enabled=False),
    }
    return ServerConfig(**{**settings, **overrides})  # type: ignore[arg-type]


@asynccontextmanager
async def serving(
    config: ServerConfig | None = None, /, **overrides: object
) -> AsyncIterator[MMCacheServer]:
    """A server on free loopback ports: `config`, or `server_config(**overrides)`;
    stopped after. Every test's server is made here (or by the fixture on it)."""
    if config is not None and overrides:
        raise TypeError("give a ServerConfig or server_config's overrides, not both")
    async with MMCacheServer(config or server_config(**overrides)) as running:  # type: ignore[arg-type]
        yield running


@asynccontextmanager
async def connected(server: MMCacheServer, **options: Any) -> AsyncIterator[MMCacheClient]:
    """A client of `server` (MMCacheClient's `options`), its mirror following the
    server's feed before the block begins (unless `follow=False`); closed after."""
    from mmcache.client import MMCacheClient

    async with MMCacheClient(f"127.0.0.1:{server.port}", **options) as client:
        if options.get("follow", True):
            await client.wait_following()
        yield client


@pytest.fixture
async def server() -> AsyncIterator[MMCacheServer]:
    async with serving() as running:
        yield running


@pytest.fixture
async def client(server: MMCacheServer) -> AsyncIterator[MMCacheClient]:
    async with connected(server) as made:
        yield made


def scrape_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text: str = response.read().decode()
    return text


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(port: int) -> Samples:
    """Every sample of the /metrics endpoint: (name, sorted labels) -> value."""
    return parse_samples(await asyncio.to_thread(scrape_text, port))


def parse_samples(text: str) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def sample(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


ROOT = Path(__file__).resolve().parent.parent


def make_certs(directory: Path) -> Path:
    """A CA with a server and a client certificate, and a tokens file (deploy/tls)."""
    import subprocess

    subprocess.run(
        [str(ROOT / "deploy/tls/make-certs.sh"), str(directory)],
        check=True,
        capture_output=True,
    )
    return directory


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ca.crt, server.crt/.key, client.crt/.key and tokens of one private CA."""
    return make_certs(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="session")
def rogue_certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same files from another CA: nothing the server should trust."""
    return make_certs(tmp_path_factory.mktemp("rogue"))
