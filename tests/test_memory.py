"""The memory hints: what they promise is checked on this very process."""

from __future__ import annotations

import ctypes
import mmap
import sys

import pytest

from mmcache._memory import prefault_in_background

MIB = 1 << 20


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE


@pytest.mark.skipif(sys.platform != "linux", reason="Linux memory advice")
def test_prefault_maps_pages_in_and_leaves_their_contents_alone() -> None:
    size = 64 * MIB
    # Fresh private anonymous memory, as malloc maps large blocks: nothing resident.
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    anchor = ctypes.c_char.from_buffer(region)
    address = ctypes.addressof(anchor)
    try:
        region[size // 2 : size // 2 + 5] = b"hello"  # written before, as frames are
        before = _resident_bytes()
        thread = prefault_in_background([(address, size)])
        if thread is None:
            pytest.skip("no glibc here")
        thread.join(timeout=30)
        assert not thread.is_alive()
        grown = _resident_bytes() - before
        if grown == 0:
            pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14+)")
        assert grown >= size - 2 * MIB
        assert region[size // 2 : size // 2 + 5] == b"hello"
        assert region[:4096] == bytes(4096) and region[-4096:] == bytes(4096)
    finally:
        del anchor  # the export must go before the map can close
        region.close()


def test_nothing_to_prefault_starts_no_thread() -> None:
    assert prefault_in_background([]) is None
