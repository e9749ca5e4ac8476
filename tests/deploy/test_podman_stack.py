"""The local stack on podman, as a newcomer without Docker starts it (docs/deploy.md)
(scripts/podman-stack.sh: podman-compose over docker-compose.yml): the sidecar
answers on its published port, Prometheus scrapes it by service name and reads
back what a client did, the shared-memory volume is a tmpfs, `down` leaves no
container, volume or network behind, and a taken port fails `up` saying so."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from mmcache.client import MMCacheClient
from tests.conftest import ROOT
from tests.deploy.checks import dashboard_exprs, load_dashboard, promql_metric_names, require
from tests.deploy.podman import BASE_IMAGE, podman, podman_flags
from tests.deploy.prometheus_harness import PrometheusAPI
from tests.items import image_item
from tests.test_process import free_port

STACK = ROOT / "scripts/podman-stack.sh"
PROMETHEUS_IMAGE = "localhost/prometheus-debian:ci"


@dataclass(frozen=True)
class Stack:
    project: str
    env: dict[str, str]
    grpc_port: int
    metrics_port: int
    prometheus_port: int

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(STACK), *args], env=self.env, capture_output=True, text=True,
            timeout=300, check=False,
        )  # fmt: skip

    def leftovers(self) -> list[str]:
        label = f"label=io.podman.compose.project={self.project}"
        containers = podman("ps", "-aq", "--filter", label).stdout.split()
        volumes = podman("volume", "ls", "-q", "--filter", f"name={self.project}_").stdout.split()
        network = podman("network", "exists", f"{self.project}_default").returncode == 0
        return containers + volumes + ([f"{self.project}_default"] if network else [])


@pytest.fixture(scope="module")
def prometheus_image(image: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """No registry is reachable from CI, so Prometheus's own image cannot be
    pulled: Debian's prometheus (2.42, as the other tests run) over the
    sidecar's Debian base stands in, with the official image's entrypoint and
    working directory."""
    context = tmp_path_factory.mktemp("prometheus-image")
    shutil.copy(require("prometheus"), context / "prometheus")
    (context / "Containerfile").write_text(
        f"FROM {BASE_IMAGE}\nCOPY prometheus /bin/prometheus\n"
        'WORKDIR /prometheus\nENTRYPOINT ["/bin/prometheus"]\n'
    )
    built = podman(
        "build", "--quiet", "--format", "docker", *podman_flags(),
        "-t", PROMETHEUS_IMAGE, str(context), timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    return PROMETHEUS_IMAGE


@pytest.fixture
def stack(image: str, prometheus_image: str) -> Iterator[Stack]:
    project = f"mmtest{os.getpid()}"
    ports = {"grpc": free_port(), "metrics": free_port(), "prometheus": free_port()}
    env = {
        **os.environ,
        "STACK_PROJECT": project,
        "MMCACHE_IMAGE": image,
        "PROMETHEUS_IMAGE": prometheus_image,
        "STACK_GRPC_PORT": str(ports["grpc"]),
        "STACK_METRICS_PORT": str(ports["metrics"]),
        "STACK_PROMETHEUS_PORT": str(ports["prometheus"]),
        "MMCACHE_CAPACITY_GB": "0.25",
    }
    stack = Stack(project, env, ports["grpc"], ports["metrics"], ports["prometheus"])
    try:
        yield stack
    finally:
        stack.run("down")


async def _put_three(port: int) -> None:
    # shm=False: the region is inside the container's volume, not on this host.
    async with MMCacheClient(f"127.0.0.1:{port}", timeout=10, shm=False) as client:
        items = [image_item(i) for i in range(3)]
        hashes = [f"stack-{i}" for i in range(3)]
        await client.get_and_update(items, hashes)
        await client.get_and_update(items, hashes)  # asked again: three hits
        # An engine's encoder book: the dashboard's encoder panels have series to show.
        book = client.encoder_cache("engine-0")
        await book.create(cache_size=1000)
        assert await book.can_allocate("req-1", "stack-0", 100, 500, 0)
        await book.allocate("req-1", "stack-0", 100)


def test_the_stack_comes_up_scrapes_the_sidecar_and_goes_down(stack: Stack) -> None:
    up = stack.run("up", "mmcache", "prometheus")
    assert up.returncode == 0, up.stdout + up.stderr
    assert f"127.0.0.1:{stack.grpc_port}" in up.stdout

    mounts = podman("exec", f"{stack.project}_mmcache_1", "cat", "/proc/mounts").stdout
    assert any(
        line.split()[1:3] == ["/run/mmcache-shm", "tmpfs"] for line in mounts.splitlines()
    ), mounts

    prometheus = PrometheusAPI(f"http://127.0.0.1:{stack.prometheus_port}")
    # Found by its service name on the stack's network (deploy/prometheus/prometheus.yml).
    prometheus.wait_for_up("mmcache", timeout=60)
    assert any(
        t["scrapeUrl"] == "http://mmcache:9470/metrics" and t["health"] == "up"
        for t in prometheus.targets()
    ), prometheus.targets()
    asyncio.run(_put_three(stack.grpc_port))
    prometheus.wait_for('mmcache_items{job="mmcache"}', lambda v: v == 3, timeout=30)
    prometheus.wait_for('sum(mmcache_hits_total{job="mmcache"})', lambda v: v == 3, timeout=30)
    # Every metric a Grafana panel queries is in what Prometheus scraped from the sidecar.
    used = set().union(
        *(promql_metric_names(expr) for _, expr in dashboard_exprs(load_dashboard()))
    )
    scraped = set(prometheus.api("label/__name__/values", **{"match[]": '{job="mmcache"}'}))
    assert used - scraped == set(), sorted(used - scraped)

    down = stack.run("down")
    assert down.returncode == 0, down.stderr
    assert stack.leftovers() == []


def test_a_taken_port_fails_up_and_says_which(stack: Stack) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", stack.grpc_port))
        taken.listen()
        up = stack.run("up", "mmcache")
    assert up.returncode == 1
    assert f"127.0.0.1:{stack.grpc_port}: bind: address already in use" in up.stderr, up.stderr
    assert f"not running: {stack.project}_mmcache_1" in up.stderr


def test_the_compose_file_takes_images_and_ports_from_the_environment() -> None:
    compose = Path(ROOT / "docker-compose.yml").read_text()
    images = ("MMCACHE_IMAGE", "PROMETHEUS_IMAGE", "GRAFANA_IMAGE")
    ports = ("STACK_GRPC_PORT", "STACK_METRICS_PORT", "STACK_PROMETHEUS_PORT", "STACK_GRAFANA_PORT")
    for variable in images + ports:
        assert "${" + variable + ":-" in compose, variable


def test_a_service_whose_image_cannot_be_had_is_named_and_up_fails(stack: Stack) -> None:
    """Grafana's image cannot be pulled without a registry: `up` says so, with
    the image and the variable that names another, and exits 3."""
    absent = f"localhost/mmcache-absent-grafana:{os.getpid()}"
    stack.env["GRAFANA_IMAGE"] = absent
    up = stack.run("up")
    assert up.returncode == 3, up.stdout + up.stderr
    assert f"grafana did not start: its image ({absent})" in up.stderr
    assert "GRAFANA_IMAGE" in up.stderr and "Traceback" not in up.stderr
    assert f"127.0.0.1:{stack.grpc_port}" in up.stdout  # the rest is up


def test_with_no_image_and_none_buildable_up_points_at_the_build_script(
    stack: Stack, tmp_path: Path
) -> None:
    """A machine with podman but no mmdebstrap: the image cannot be built, and
    `up` says where the build is and why it failed, not a registry's error."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in Path("/usr/bin").iterdir():
        if tool.name != "mmdebstrap":
            (bin_dir / tool.name).symlink_to(tool)
    stack.env["PATH"] = str(bin_dir)
    stack.env["MMCACHE_IMAGE"] = f"localhost/mmcache-absent:{os.getpid()}"
    up = stack.run("up", "mmcache")
    assert up.returncode == 1, up.stdout + up.stderr
    assert "scripts/image-build.sh could not build it" in up.stderr
    assert "mmdebstrap is missing" in up.stderr
