"""`mmcache stats`, `mmcache locate`, `mmcache clear`: the commands a person
runs against a live server, as processes, against a real server."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
from pathlib import Path

import torch

from mmcache.client import MMCacheClient

from .conftest import MMCACHE, serving, store_of
from .items import image_item

ADMIN, WRITE = "admin-token-0123456789", "write-token-0123456789"


async def mmcache(
    *args: str, stdin: str = "", env: dict[str, str] | None = None
) -> tuple[int, str]:
    """Run the `mmcache` command (off the event loop: the server runs on it)."""

    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [MMCACHE, *args], input=stdin, capture_output=True, text=True, timeout=30, env=env
        )

    done = await asyncio.to_thread(run)
    return done.returncode, done.stdout + done.stderr


async def test_stats_locate_and_clear_look_inside_a_running_server() -> None:
    async with serving() as server:
        target = f"127.0.0.1:{server.port}"
        async with MMCacheClient(target) as client:
            await client.get_and_update([image_item(1), image_item(2)], ["a", "b"], lease=False)
            await client.lookup(["a", "c"])  # a hit (leased), a miss

        code, shown = await mmcache("stats", target)
        assert code == 0
        assert "items      2 (" in shown
        assert "hit ratio  25.0% (1 hits of 4 queries since start)" in shown
        assert "leases     1 (" in shown and "L2 tier    none" in shown

        # --watch: the view again and again, the terminal cleared before each.
        watching = await asyncio.create_subprocess_exec(
            MMCACHE, "stats", target, "--watch", "0.1", stdout=asyncio.subprocess.PIPE
        )
        assert watching.stdout is not None
        seen = b""
        async with asyncio.timeout(30):  # a loaded machine starts the process slowly
            while seen.count(b"\x1b[H\x1b[2J") < 3:
                seen += await watching.stdout.read(4096)
        watching.terminate()
        await watching.communicate()
        assert b"hit ratio  25.0%" in seen.split(b"\x1b[H\x1b[2J")[2]

        code, shown = await mmcache("locate", "--target", target, "a", "zzz")
        assert code == 0
        lines = shown.strip().splitlines()
        assert lines[0].startswith("a  held here (") and lines[1] == "zzz  not held"

        code, shown = await mmcache("clear", "--target", target, stdin="n\n")
        assert code == 1 and "nothing removed" in shown and len(store_of(server)) == 2
        code, shown = await mmcache("clear", "--target", target, "--yes")
        assert code == 0 and "removed 1 items" in shown and "1 leased ones stay" in shown
        assert store_of(server).keys() == ["a"]  # leased: kept until read


async def test_clear_needs_an_admin_token_and_says_so() -> None:
    async with serving(tokens=f"admin {ADMIN}; write {WRITE}") as server:
        target = f"127.0.0.1:{server.port}"
        code, shown = await mmcache(
            "clear", "--target", target, "--yes", env={"MMCACHE_TOKEN": WRITE, "PATH": ""}
        )
        assert code == 1 and "PERMISSION_DENIED" in shown and "admin" in shown
        code, shown = await mmcache(
            "clear", "--target", target, "--yes", env={"MMCACHE_TOKEN": ADMIN, "PATH": ""}
        )
        assert code == 0 and "removed 0 items" in shown
        code, shown = await mmcache("stats", target, env={"MMCACHE_TOKEN": WRITE, "PATH": ""})
        assert code == 0 and "hit ratio  no queries yet" in shown


async def test_get_writes_an_items_tensors_and_where_each_lies(tmp_path: Path) -> None:
    item = image_item(3, numel=1000)
    async with serving() as server:
        target = f"127.0.0.1:{server.port}"
        async with MMCacheClient(target) as client:
            await client.get_and_update([item], ["cat"], lease=False)
        code, shown = await mmcache("get", "cat", "--target", target, "--out", str(tmp_path))
        assert code == 0 and "payload.bin" in shown
        spec = json.loads((tmp_path / "spec.json").read_text())
        payload = (tmp_path / "payload.bin").read_bytes()
        # Every tensor, at its place in the payload, holds the bytes uploaded.
        tensors = {t["path"]: t for t in spec["tensors"]}
        for key, elem in item.items():
            where = tensors[key]
            data = elem.data
            assert (where["dtype"], where["shape"]) == (str(data.dtype).removeprefix("torch."),
                                                         list(data.shape))  # fmt: skip
            got = payload[where["offset"] : where["offset"] + where["nbytes"]]
            assert got == data.contiguous().view(torch.uint8).numpy().tobytes()
        code, shown = await mmcache("get", "dog", "--target", target, "--out", str(tmp_path))
        assert code == 1 and "NOT_FOUND" in shown


def _interruptible() -> None:
    """In the child, before it runs: SIGINT as from a terminal. A test run in
    a background job (`make test &`) starts with SIGINT ignored, which its
    children inherit, and Python then never makes it a KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


async def test_a_persons_mistakes_get_one_line_and_no_traceback() -> None:
    """Ctrl-C in --watch, clear with nobody to ask, --watch 0: each a line, no traceback."""
    async with serving() as server:
        target = f"127.0.0.1:{server.port}"
        watching = await asyncio.create_subprocess_exec(
            MMCACHE, "stats", target, "--watch", "0.1",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            preexec_fn=_interruptible,
        )  # fmt: skip
        await asyncio.sleep(1.5)
        watching.send_signal(signal.SIGINT)
        seen, said = await watching.communicate()
        assert watching.returncode == 130
        assert b"hit ratio" in seen and b"Traceback" not in said + seen

        code, shown = await mmcache("clear", "--target", target)  # stdin closed: no answer
        assert code == 2 and "pass --yes" in shown and "Traceback" not in shown
        assert "nothing removed" in shown

    for pause in ("0", "-1", "nan", "soon"):
        code, shown = await mmcache("stats", "127.0.0.1:1", "--watch", pause)
        assert code == 2 and "0.1 or more" in shown and "Traceback" not in shown
