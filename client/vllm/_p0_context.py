"""What the parts of one P0 cache share (_p0_lookup.py, _p0_sharing.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ._costs import ProcessingTime
from ._small import SmallImages
from ._updates import KnownUpdates
from .runtime import SyncClient

__all__ = ["P0Context"]


@dataclass(frozen=True)
class P0Context:
    """One P0 cache's sidecar, keys, and what it knows and measures."""

    sync: SyncClient  # the process's client: every call goes through it
    key: Callable[[str], str]  # vLLM's hash -> the server's key
    known: KnownUpdates  # prompt updates of what this process processed
    processing: ProcessingTime  # measured by Sharing, read by Lookup
    shareable: Callable[[str], bool]  # which hashes are the fleet's (_digests.py)
    small: SmallImages  # images kept here as vLLM alone keeps them (_small.py)
    single_flight: bool = False  # claim new images at the sidecar (_p0_lookup.py)
    # Small images kept here go up into the sidecar's shared memory where
    # single flight is on (_p0_sharing.py); False: never (MMCACHE_SHARE_SMALL=off).
    share_kept: bool = True
