"""What a dead sidecar costs each call of a request (docs/faults.md).

    python -m bench.faults [--deadline-s 1.0] [--rounds 5]

A sidecar (`mmcache serve`, its own process, a shared-memory region in a
temporary directory) and a co-located client failing open after
`deadline_s` (the plugin's MMCACHE_DEADLINE_S). The client uploads an item,
leases it, and maps the region; then the sidecar is SIGKILLed, SIGSTOPped,
or was never there (a closed port), and each call a frontend's or an
engine's request makes is timed `rounds` times. Prints, per fault, each
call's median and worst added latency in ms, and what it returned.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from mmcache.client import FailOpen, MMCacheClient

STALE_WAIT_S = 2.5  # past the region's heartbeat bound (2 s)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def serve(shm_dir: str, port: int) -> subprocess.Popen[bytes]:
    args = ["--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(free_port())]
    args += ["--shm-dir", shm_dir, "--shm-mb", "64", "--capacity-gb", "0.25", "--grace-s", "0"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "mmcache.server", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("the sidecar did not start")


def calls(client: MMCacheClient) -> dict[str, Callable[[], Awaitable[Any]]]:
    big = {"x": torch.randn(1 << 18)}  # 1 MiB: through the region (ShmAllocate)
    small = {"x": torch.randn(64)}
    return {
        "get_and_update": lambda: client.get_and_update([small], ["new-small"]),
        "get_and_update, 1 MiB": lambda: client.get_and_update([big], ["new-big"]),
        "lookup": lambda: client.lookup(["held"], want_metadata=True),
        "lease_resident (no call)": lambda: _now(client.lease_resident(["held"]).held),
        "fetch_resident (no call)": lambda: _now(client.fetch_resident(["held"])),
        "fetch": lambda: client.fetch(["held"]),
        "release": lambda: client.release(["held"]),
        "refresh": lambda: client.refresh(["held"]),
        "locate": lambda: client.locate(["held"]),
    }


async def _now(value: Any) -> Any:
    return value


async def timed(call: Callable[[], Awaitable[Any]]) -> tuple[float, str]:
    began = time.perf_counter()
    try:
        got = repr(await call())[:40]
    except Exception as exc:  # a read cannot fail open: it raises
        got = type(exc).__name__
    return (time.perf_counter() - began) * 1000, got


async def measure(client: MMCacheClient, rounds: int) -> dict[str, tuple[list[float], str]]:
    out: dict[str, tuple[list[float], str]] = {}
    for name, call in calls(client).items():
        took: list[float] = []
        got = ""
        for _ in range(rounds):
            ms, got = await timed(call)
            took.append(ms)
        out[name] = (took, got)
    return out


async def prepared(port: int, deadline_s: float) -> MMCacheClient:
    client = MMCacheClient(f"127.0.0.1:{port}", fail_open=FailOpen(deadline_s))
    await client.connect()
    await client.get_and_update([{"x": torch.randn(1 << 18)}], ["held"], lease=False)
    await client.lookup(["held"])
    return client


async def run(fault: str, deadline_s: float, rounds: int) -> dict[str, tuple[list[float], str]]:
    with tempfile.TemporaryDirectory() as shm_dir:
        port = free_port()
        if fault == "unreachable":
            client = MMCacheClient(f"127.0.0.1:{port}", fail_open=FailOpen(deadline_s))
            await client.connect()
            try:
                return await measure(client, rounds)
            finally:
                await client.close()
        proc = serve(shm_dir, port)
        try:
            client = await prepared(port, deadline_s)
            os.kill(proc.pid, signal.SIGKILL if fault == "SIGKILL" else signal.SIGSTOP)
            await asyncio.sleep(STALE_WAIT_S)
            try:
                return await measure(client, rounds)
            finally:
                os.kill(proc.pid, signal.SIGCONT)  # (a killed one: no matter)
                await client.close()
        finally:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deadline-s", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(f"deadline {args.deadline_s:g} s; ms added, median / worst of {args.rounds}\n")
    print("| call | SIGKILL | SIGSTOP | unreachable | result (SIGSTOP) |")
    print("|---|---|---|---|---|")
    results = {f: asyncio.run(run(f, args.deadline_s, args.rounds)) for f in _FAULTS}
    for name in results["SIGKILL"]:
        cells = []
        for fault in _FAULTS:
            took = results[fault][name][0]
            cells.append(f"{statistics.median(took):.1f} / {max(took):.1f}")
        print(f"| {name} | {' | '.join(cells)} | `{results['SIGSTOP'][name][1]}` |")


_FAULTS = ("SIGKILL", "SIGSTOP", "unreachable")

if __name__ == "__main__":
    main()
