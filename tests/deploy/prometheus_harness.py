"""A real Prometheus (Debian's `prometheus` binary) for tests.

    with running_prometheus({"mmcache": [f"127.0.0.1:{metrics_port}"]}, tmp_path) as prom:
        prom.wait_for_up("mmcache")
        ...drive traffic...
        prom.wait_for('sum(mmcache_queries_total{job="mmcache"})', lambda v: v == 10)

It listens on a free loopback port, scrapes every target each second (and itself,
as job "prometheus"), keeps its TSDB under the given folder, and is stopped (SIGTERM,
then SIGKILL) on exit. Queries use the HTTP API's instant query (/api/v1/query).
`promtool_check_metrics` lints an exposition with `promtool check metrics`.

The binaries come from the Debian package `prometheus` (scripts/install-system-deps.sh);
without them these helpers fail with that hint instead of skipping.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.deploy.checks import require

Sample = tuple[dict[str, str], float]  # (labels, value) of one instant-vector element


class PrometheusError(RuntimeError):
    pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def scrape_config(
    targets: Mapping[str, Sequence[str]], self_address: str, interval: str = "1s"
) -> dict[str, Any]:
    """A Prometheus config: one job per entry of `targets` (job -> host:port list),
    plus job "prometheus" scraping `self_address`."""
    jobs = {"prometheus": [self_address], **targets}
    return {
        "global": {"scrape_interval": interval, "scrape_timeout": interval,
                   "evaluation_interval": interval},
        "scrape_configs": [
            {"job_name": job, "metrics_path": "/metrics",
             "static_configs": [{"targets": list(addresses)}]}
            for job, addresses in jobs.items()
        ],
    }  # fmt: skip


@dataclass
class PrometheusAPI:
    """Any Prometheus's HTTP API at `url` (e.g. one in a container)."""

    url: str

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/PATH; the `data` of a successful answer."""
        query = urllib.parse.urlencode(params)
        url = f"{self.url}/api/v1/{path}" + (f"?{query}" if query else "")
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                body = json.load(response)
        except urllib.error.HTTPError as exc:  # 400/422: a bad query; the body says why
            body = json.loads(exc.read() or b"{}")
        if body.get("status") != "success":
            raise PrometheusError(f"{url}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[Sample]:
        """Instant query; the samples of the resulting vector (a scalar becomes one
        sample with no labels)."""
        data = self.api("query", query=expr)
        if data["resultType"] == "vector":
            return [(r["metric"], float(r["value"][1])) for r in data["result"]]
        if data["resultType"] == "scalar":
            return [({}, float(data["result"][1]))]
        raise PrometheusError(f"{expr!r} gave a {data['resultType']}, not a vector")

    def query_value(self, expr: str) -> float | None:
        """The value of a single-sample query, None when the vector is empty."""
        samples = self.query(expr)
        if len(samples) > 1:
            raise PrometheusError(f"{expr!r} gave {len(samples)} samples: {samples}")
        return samples[0][1] if samples else None

    def wait_for(
        self,
        expr: str,
        predicate: Callable[[float], bool] = lambda _: True,
        timeout: float = 20,
    ) -> float:
        """Poll `expr` until it has one sample whose value satisfies `predicate`."""
        deadline = time.monotonic() + timeout
        last: float | None = None
        while True:
            last = self.query_value(expr)
            if last is not None and predicate(last):
                return last
            if time.monotonic() > deadline:
                raise PrometheusError(
                    f"{expr!r} is {last!r} after {timeout}s; targets: {self.targets()}"
                )
            time.sleep(0.2)

    def wait_for_up(self, job: str, timeout: float = 20) -> None:
        """Until every target of `job` has been scraped successfully."""
        self.wait_for(f'min(up{{job="{job}"}})', lambda v: v == 1, timeout)

    def targets(self) -> list[dict[str, Any]]:
        """Active targets: job, scrapeUrl, health, lastError."""
        return [
            {k: t.get(k) for k in ("scrapePool", "scrapeUrl", "health", "lastError")}
            for t in self.api("targets")["activeTargets"]
        ]


@dataclass
class Prometheus(PrometheusAPI):
    """One these helpers started, with its process and log."""

    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def _wait_ready(prom: Prometheus, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if prom.process.poll() is not None:
            raise PrometheusError(
                f"prometheus exited with {prom.process.returncode}:\n{prom.log()}"
            )
        try:
            with urllib.request.urlopen(f"{prom.url}/-/ready", timeout=1) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.1)
    raise PrometheusError(f"prometheus not ready after {timeout}s:\n{prom.log()}")


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def running_prometheus(
    targets: Mapping[str, Sequence[str]],
    workdir: Path,
    *,
    scrape_interval: str = "1s",
    ready_timeout: float = 30,
) -> Iterator[Prometheus]:
    """Start Prometheus on a free 127.0.0.1 port scraping `targets` (job -> ["host:port",
    ...]) every `scrape_interval`; yield it once /-/ready answers; stop it on exit."""
    binary = require("prometheus")
    workdir.mkdir(parents=True, exist_ok=True)
    for attempt in range(3):  # the free port may be taken before prometheus binds it
        port = free_port()
        address = f"127.0.0.1:{port}"
        config_path = workdir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(scrape_config(targets, address, scrape_interval)))
        log_path = workdir / f"prometheus-{attempt}.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [
                    binary,
                    f"--config.file={config_path}",
                    f"--storage.tsdb.path={workdir / 'data'}",
                    f"--web.listen-address={address}",
                    "--web.enable-lifecycle",
                    "--log.level=info",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        prom = Prometheus(url=f"http://{address}", process=process, log_path=log_path)
        try:
            _wait_ready(prom, ready_timeout)
        except PrometheusError:
            _stop(process)
            if "address already in use" in prom.log() and attempt < 2:
                continue
            raise
        try:
            yield prom
        finally:
            _stop(process)
        return


def promtool_check_metrics(exposition: str) -> subprocess.CompletedProcess[str]:
    """`promtool check metrics` on an exposition: returncode 0 when it parses and
    lints clean; its output lists the problems otherwise."""
    return subprocess.run(
        [require("promtool"), "check", "metrics"],
        input=exposition,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def fetch_text(url: str, timeout: float = 5) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        text: str = response.read().decode()
        return text
