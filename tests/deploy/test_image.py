"""The sidecar image, built with podman (scripts/image-build.sh: a Debian base
made by mmdebstrap, the tested pins from a local wheelhouse) and run for real:
health, /metrics, its user, SIGTERM, an early SIGTERM, and its size."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator

import pytest

from tests.conftest import MMCACHE, parse_samples, sample, scrape_text
from tests.deploy.podman import podman, podman_flags
from tests.test_process import free_port

GRACE_S = 3


def healthy(port: int) -> bool:
    probe = [MMCACHE, "health", f"127.0.0.1:{port}", "--timeout", "1"]
    return subprocess.run(probe, capture_output=True, timeout=10, check=False).returncode == 0


@pytest.fixture
def container(image: str) -> Iterator[tuple[str, int, int]]:
    port, metrics_port = free_port(), free_port()
    started = podman(
        "run", "-d", *podman_flags(),
        "-e", "MMCACHE_HOST=127.0.0.1", "-e", f"MMCACHE_PORT={port}",
        "-e", f"MMCACHE_METRICS_PORT={metrics_port}", "-e", "MMCACHE_CAPACITY_GB=0.0625",
        "-e", f"MMCACHE_GRACE_S={GRACE_S}", "-e", "MMCACHE_SHM=0",
        image,
    )  # fmt: skip
    assert started.returncode == 0, started.stderr
    name = started.stdout.strip()
    try:
        yield name, port, metrics_port
    finally:
        podman("rm", "-f", "-t", "0", name)


def test_the_image_serves_runs_unprivileged_and_stops_cleanly(
    container: tuple[str, int, int],
) -> None:
    name, port, metrics_port = container
    deadline = time.monotonic() + 30
    while not healthy(port):
        assert time.monotonic() < deadline, podman("logs", name).stderr
        time.sleep(0.2)
    samples = parse_samples(scrape_text(metrics_port))
    assert sample(samples, "mmcache_capacity_bytes") == 2**26
    ids = podman("exec", name, "sh", "-c", "id -u; id -g").stdout.split()
    assert ids == ["10001", "10001"]  # its own user and group, not root's
    pid1 = podman("exec", name, "cat", "/proc/1/comm").stdout.strip()
    assert pid1 == "tini"
    started = time.monotonic()
    stopped = podman("stop", "-t", str(GRACE_S + 10), name)
    assert stopped.returncode == 0, stopped.stderr
    assert time.monotonic() - started < GRACE_S + 5  # not SIGKILLed after the runtime's wait
    state = json.loads(podman("inspect", name).stdout)[0]["State"]
    assert state["ExitCode"] == 0, podman("logs", name).stderr


def test_a_sigterm_right_after_the_start_stops_the_container(image: str) -> None:
    port, metrics_port = free_port(), free_port()
    started = podman(
        "run", "-d", *podman_flags(),
        "-e", "MMCACHE_HOST=127.0.0.1", "-e", f"MMCACHE_PORT={port}",
        "-e", f"MMCACHE_METRICS_PORT={metrics_port}", "-e", "MMCACHE_SHM=0",
        "-e", f"MMCACHE_GRACE_S={GRACE_S}", image,
    )  # fmt: skip
    name = started.stdout.strip()
    try:
        podman("kill", "--signal", "TERM", name)
        waited = podman("wait", name, timeout=GRACE_S + 20)
        # 0: the server stopped itself; 143: tini's child ended by the signal
        # before it could catch it. Never a hang that ends in SIGKILL (137).
        assert waited.stdout.strip() in ("0", "143"), waited.stdout + waited.stderr
    finally:
        podman("rm", "-f", "-t", "0", name)
