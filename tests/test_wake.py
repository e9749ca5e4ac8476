"""The region's wake pipe (mmcache._wake): a poke never blocks its client and
never fails it, whatever state the server's end is in."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from mmcache._wake import POKE, Poker, wake_path
from mmcache.server.cache._wake import WakePipe


def test_pokes_are_read_whole_and_a_full_or_closed_pipe_drops_them(tmp_path: Path) -> None:
    region = str(tmp_path / "mmcache-1-x.shm")
    pipe = WakePipe.open(region, group=None)
    assert pipe is not None and pipe.path == wake_path(region)
    poker = Poker.open(region)
    assert poker is not None
    assert poker.poke(7) and poker.poke(2**63 + 1)
    assert pipe.read() == [7, 2**63 + 1]
    assert pipe.read() == []
    # Full (the server is stalled): pokes are dropped, never block.
    pokes = 0
    while poker.poke(9):
        pokes += 1
    assert pokes * POKE.size >= 4096
    assert not poker.poke(9)
    assert len(pipe.read()) == pokes  # all of them, over reads of a pipe's buffer
    pipe.close()  # the server stopped: the next poke finds no reader
    assert not os.path.exists(wake_path(region))
    assert not poker.poke(1) and not poker.poke(1)
    poker.close()
    poker.close()


def test_no_pipe_means_no_poker(tmp_path: Path) -> None:
    region = tmp_path / "mmcache-1-y.shm"
    assert Poker.open(str(region)) is None  # an older server made none
    Path(wake_path(str(region))).write_bytes(b"")  # a file that is no FIFO
    assert Poker.open(str(region)) is None
    os.unlink(wake_path(str(region)))
    os.mkfifo(wake_path(str(region)))  # a FIFO nobody reads: its server is gone
    assert Poker.open(str(region)) is None


def test_a_poke_into_a_pipe_with_no_reader_never_kills_its_process(tmp_path: Path) -> None:
    """A process whose SIGPIPE is at its default (Python ignores it; a host
    embedding it may not) survives a poke after its server is gone."""
    script = f"""
import os, signal
from mmcache._wake import Poker, wake_path
from mmcache.server.cache._wake import WakePipe
signal.signal(signal.SIGPIPE, signal.SIG_DFL)
region = {str(tmp_path / "mmcache-1-z.shm")!r}
pipe = WakePipe.open(region, group=None)
poker = Poker.open(region)
assert pipe is not None and poker is not None and poker.poke(1)
os.close(pipe.fd)
os.close(pipe._keep)  # the server is gone: no reader
print("poked", poker.poke(2), poker.poke(3))
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, (done.returncode, done.stderr)
    assert done.stdout.strip() == "poked False False"
