"""The server as a process: CLI, environment, health, reflection, SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from .conftest import MMCACHE, parse_samples, sample, scrape_text


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_serving(port: int, proc: subprocess.Popen[str], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited early: {proc.communicate()}")
        if health(port) == 0:
            return
        time.sleep(0.1)
    raise AssertionError("server did not become SERVING")


def health(port: int) -> int:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mmcache.server._cli",
            "health",
            f"127.0.0.1:{port}",
            "--timeout",
            "1",
        ],
        capture_output=True,
        text=True,
        check=False,
    ).returncode


@pytest.fixture
def ports() -> tuple[int, int]:
    return free_port(), free_port()


def start(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        args,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture
def proc_env(ports: tuple[int, int]) -> Iterator[subprocess.Popen[str]]:
    port, metrics_port = ports
    proc = start(
        [MMCACHE, "serve"],
        env={
            "MMCACHE_HOST": "127.0.0.1",
            "MMCACHE_PORT": str(port),
            "MMCACHE_METRICS_PORT": str(metrics_port),
            "MMCACHE_CAPACITY_GB": "0.25",
            "MMCACHE_GRACE_S": "5",
        },
    )
    try:
        wait_serving(port, proc)
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_serve_reads_environment_and_exports_metrics(
    proc_env: subprocess.Popen[str], ports: tuple[int, int]
) -> None:
    samples = parse_samples(scrape_text(ports[1]))
    assert sample(samples, "mmcache_capacity_bytes") == int(0.25 * 2**30)
    # No MMCACHE_MAX_ITEMS: 65536 items, plus one per 8 KiB of the 0.25 GiB.
    assert sample(samples, "mmcache_max_items") == 65536 + 32768
    assert any(name == "mmcache_build_info" for name, _ in samples)


def test_flags_override_and_python_m_works(ports: tuple[int, int]) -> None:
    port, metrics_port = ports
    proc = start(
        [
            sys.executable,
            "-m",
            "mmcache.server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--metrics-port",
            str(metrics_port),
            "--capacity-gb",
            "0.5",
            "--max-items",
            "7",
        ],
        env={"MMCACHE_CAPACITY_GB": "3", "MMCACHE_MAX_ITEMS": "9"},
    )
    try:
        wait_serving(port, proc)
        samples = parse_samples(scrape_text(metrics_port))
        assert sample(samples, "mmcache_capacity_bytes") == 2**29
        assert sample(samples, "mmcache_max_items") == 7
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0


def test_sigterm_goes_not_serving_lets_calls_finish_and_exits_zero(
    proc_env: subprocess.Popen[str], ports: tuple[int, int]
) -> None:
    port = ports[0]
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    # An upload left open: SIGTERM must wait for it (up to the grace) ...
    upload = channel.stream_unary("/mmcache.v1.MMCache/GetAndUpdate")
    from .raw import chunk, data_entry, header, tensor_spec

    release = __import__("threading").Event()

    def frames() -> Iterator[bytes]:
        yield header(data_entry("slow", tensor_spec("uint8", [4]), 1))
        release.wait(10)
        yield chunk(b"1234")

    future = upload.future(frames(), timeout=20)

    def uploads_started() -> float:
        samples = parse_samples(scrape_text(ports[1]))
        return sum(
            value
            for (name, labels), value in samples.items()
            if name == "grpc_server_started_total" and ("grpc_method", "GetAndUpdate") in labels
        )

    deadline = time.monotonic() + 15
    while uploads_started() < 1:  # the call is in before the signal
        assert time.monotonic() < deadline, "the upload never reached the server"
        time.sleep(0.02)
    proc_env.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert proc_env.poll() is None  # still draining
    # ... and new calls are refused meanwhile.
    check = channel.unary_unary(
        "/grpc.health.v1.Health/Check",
        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        response_deserializer=health_pb2.HealthCheckResponse.FromString,
    )
    with pytest.raises(grpc.RpcError):
        check(health_pb2.HealthCheckRequest(), timeout=2)
    release.set()
    reply = future.result(timeout=10)
    assert reply  # the in-flight upload completed
    assert proc_env.wait(timeout=10) == 0
    _, err = proc_env.communicate()
    assert "shutting down" in err
    channel.close()


def test_health_fails_when_nothing_listens() -> None:
    assert health(free_port()) == 1


def test_port_in_use_fails_with_a_clear_message(
    proc_env: subprocess.Popen[str], ports: tuple[int, int]
) -> None:
    port, _ = ports
    second = subprocess.run(
        [MMCACHE, "serve", "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0"],
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
    )
    assert second.returncode == 2
    # One line, naming the port and what to do; no raw gRPC log line before it.
    (line,) = second.stderr.strip().splitlines()
    assert f"port {port} on 127.0.0.1 is in use by another process" in line
    assert "--port, or 0 for a free one" in line


def test_bad_flag_values_are_refused_with_reasons() -> None:
    result = subprocess.run(
        [MMCACHE, "serve", "--capacity-gb", "-1"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 2 and "GiB >= 0" in result.stderr
    result = subprocess.run(
        [MMCACHE, "serve", "--max-items", "0"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 2 and "--max-items" in result.stderr
    assert "whole number >= 1" in result.stderr
    result = subprocess.run(
        [MMCACHE, "serve"],
        env={**os.environ, "MMCACHE_PORT": "http"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode != 0 and "MMCACHE_PORT" in result.stderr
    # A value that is no number: one line, with the unit and an example.
    result = subprocess.run(
        [MMCACHE, "serve", "--l2-timeout-ms", "soon"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "mmcache serve: argument --l2-timeout-ms: 'soon': not a number: --l2-timeout-ms takes "
        "MS, e.g. 500 (`mmcache serve --help` lists every flag)"
    ]


def test_help_names_each_flags_unit() -> None:
    shown = subprocess.run(
        [MMCACHE, "serve", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for flag in ("--capacity-gb GB", "--shm-mb MB", "--l2-timeout-ms MS", "--lease-s SECONDS"):
        assert flag in shown
    assert "CAPACITY_BYTES" not in shown and "L2_TIMEOUT_S" not in shown


def test_a_mistyped_variable_and_an_unusable_shm_dir_are_warnings(tmp_path: Path) -> None:
    env = {**os.environ, "MMCACHE_CAPACITY_G": "3", "MMCACHE_TARGET": "127.0.0.1:1"}
    proc = subprocess.Popen(
        [MMCACHE, "serve", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
         "--shm-dir", str(tmp_path / "absent"), "--grace-s", "0"],
        env=env, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stderr is not None
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if "serving gRPC" in line:
            break
    proc.send_signal(signal.SIGTERM)
    proc.wait(20)
    text = "".join(lines)
    assert (
        "WARNING mmcache.server: environment variable MMCACHE_CAPACITY_G is not an mmcache "
        "setting; did you mean MMCACHE_CAPACITY_GB?" in text
    )
    assert "MMCACHE_TARGET" not in text  # the client's: no typo
    assert "WARNING mmcache.server.cache._open: shared memory off" in text


def test_every_variable_the_client_and_plugin_read_is_no_typo_to_the_server() -> None:
    """A sidecar started from the shell that runs vLLM sees the plugin's
    variables too: none may be warned about as a typo."""
    from mmcache.server._config import unknown_variables

    root = Path(__file__).resolve().parents[1]
    named = {
        match
        for path in (*root.glob("client/**/*.py"), *root.glob("scripts/*"))
        if path.is_file()
        for match in re.findall(r"MMCACHE_[A-Z0-9_]*[A-Z0-9]", path.read_text(errors="ignore"))
    }
    assert {"MMCACHE_TARGET", "MMCACHE_SHARE_SMALL", "MMCACHE_SINGLE_FLIGHT"} <= named
    assert unknown_variables(dict.fromkeys(named, "1")) == []


def test_reflection_lists_the_services(
    proc_env: subprocess.Popen[str], ports: tuple[int, int]
) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{ports[0]}") as channel:
        info = channel.stream_stream(
            "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        replies = list(
            info(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        )
    names = {s.name for s in replies[0].list_services_response.service}
    assert {"mmcache.v1.MMCache", "grpc.health.v1.Health"} <= names


def _as_pid_one() -> list[str]:
    """A prefix that runs a command as PID 1 of a new PID namespace (as in a
    container without an init), where the kernel drops a signal the process has
    no handler for; empty where this machine cannot make one."""
    probe = subprocess.run(
        ["unshare", "--pid", "--fork", "--kill-child", "true"], capture_output=True, check=False
    )
    return ["unshare", "--pid", "--fork", "--kill-child"] if probe.returncode == 0 else []


def _server_pid(proc: subprocess.Popen[str]) -> int:
    """The server's pid: unshare's child where unshare runs it (signals go to the
    server itself, as a container runtime sends them to PID 1)."""
    if proc.args[0] != "unshare":  # type: ignore[index]
        return proc.pid
    for _ in range(200):
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        if children:
            return int(children[0])
        time.sleep(0.005)
    raise AssertionError("unshare started no server")


def _catches_sigterm(pid: int) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
    return False


@pytest.mark.parametrize("delay", [0.0, 0.2, 0.6])
def test_a_stop_sent_while_the_server_starts_is_not_lost(delay: float) -> None:
    """From the moment the process catches SIGTERM (its first step) to the
    moment it serves, a stop ends it cleanly: exit 0, not a SIGKILL after the
    runtime's grace. (Before that step, in the interpreter's own start, the
    image's init, tini, stands in: a signal then ends the process at once.)"""
    port, metrics_port = free_port(), free_port()
    proc = start(
        [*_as_pid_one(), MMCACHE, "serve"],
        env={
            "MMCACHE_HOST": "127.0.0.1",
            "MMCACHE_PORT": str(port),
            "MMCACHE_METRICS_PORT": str(metrics_port),
            "MMCACHE_CAPACITY_GB": "0.1",
            "MMCACHE_GRACE_S": "0",
        },
    )
    pid = _server_pid(proc)
    deadline = time.monotonic() + 10
    while not _catches_sigterm(pid):
        assert time.monotonic() < deadline, "the server never caught SIGTERM"
        time.sleep(0.001)
    # Caught long before the port is bound: no window in which a stop is dropped.
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0, "SIGTERM caught only once serving"
    time.sleep(delay)  # importing, or starting: before the server serves
    os.kill(pid, signal.SIGTERM)
    try:
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
