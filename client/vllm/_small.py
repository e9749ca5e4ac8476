"""Small images are kept as vLLM alone keeps them: cheaper to process than to share by call.

Sharing an item costs calls: the lookup that claims it, its upload, and in
every other API process a lookup and a read of it. A call costs about
0.5-0.9 ms of an API process's CPU and as much of the sidecar's
(docs/vllm.md, `python -m bench.upload_cost`). An icon (64x64) costs its
processor about 2.3 ms, so on a trace of new icons sharing by calls made
vLLM slower (issue 42's icons-distinct-then-repeat: 0.73x requests/s),
however many hits it gave.

The rule: an image of at most `SMALL_PIXELS` pixels whose item came out
under `SMALL_BYTES` the last time this process processed an image of the
same dimensions and settings is **kept as vLLM alone keeps it**: in this
process's own cache (`LocalCache`), never looked up by call nor claimed; a
hit of that cache goes inline, a miss is processed here. Both sizes are
facts, not estimates: the input's from its header (`input_shape`, recorded as
vLLM hashes it), the item's measured here on the same input shape. Where
other API processes share the sidecar (single flight on: several API
servers), a kept image is shared all the same, through the sidecar's shared
memory alone, where nothing costs a call but its upload:

- a processed one the sidecar lacks goes up with the request's upload (in
  the background, through a write slot, so it is resident at once);
- one another process shared is leased there with no call (_p0_lookup.py's
  `_kept_from_region`) and the engine reads it there with no call; one not
  resident there (moved out to the heap) is processed here, with no call;
- while the sidecar finds the small items it stored seldom asked for again
  (server/cache/_reuse.py), only those of a one-in-8 sample by key go up
  (_p0_sharing.py's `_shares_kept`): icons each sent once no longer pay an
  upload each (the first 32, then one in 8, still do).

So:

- for such an image the hits are at least vLLM alone's (its own cache is
  vLLM alone's) and it never costs a lookup or claim by call; with one
  API server it costs no call at all (its counts reach the sidecar in the
  next report);
- every other item is shared as before, and the first image of each shape a
  process sees is shared too (nothing is known of it yet): a model that
  enlarges small images (PaliGemma, LLaVA) makes large items of them, which
  stay shared;
- an image named by a client's uuid, or hashed by no hasher here, has no
  shape: shared by the rules it had (_digests.py).

`MMCACHE_SHARE_SMALL=on` shares every item by the common rules; `off`
keeps small images in their process with several API servers too, not
uploaded (but the first of each dimensions, as above): vLLM alone's work
and hits on them, for traffic of small images alone, where an upload costs
about what the processing it saves does (docs/benchmarks.md).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from mmcache.client.colocated import SHM_MIN_BYTES

from ._digests import Shape

__all__ = ["SMALL_BYTES", "SMALL_PIXELS", "SmallImages"]

SMALL_PIXELS = 256 * 256
# Under this an upload goes over gRPC into the sidecar's heap, where every read
# of it by another process is a call (docs/shm.md), unless sent resident.
SMALL_BYTES = SHM_MIN_BYTES
_SHAPES = 4096  # shapes remembered, newest kept: images come in few sizes


class SmallImages:
    """Which images this process keeps to itself: thread-safe (vLLM's pool
    runs requests on several threads)."""

    def __init__(self, shape_of: Callable[[str], Shape | None]) -> None:
        self._shape_of = shape_of
        self._small: OrderedDict[Shape, bool] = OrderedDict()
        self._lock = threading.Lock()

    def processed(self, mm_hash: str, nbytes: int) -> None:
        """Learn from an item processed here: its input's shape makes items of
        `nbytes`."""
        shape = self._shape_of(mm_hash)
        if shape is None:
            return
        small = shape[0] * shape[1] <= SMALL_PIXELS and nbytes < SMALL_BYTES
        with self._lock:
            self._small[shape] = small
            self._small.move_to_end(shape)
            if len(self._small) > _SHAPES:
                self._small.popitem(last=False)

    def is_small(self, mm_hash: str) -> bool:
        """Whether the image under `mm_hash` stays here: its shape made a small
        item here before."""
        shape = self._shape_of(mm_hash)
        if shape is None:
            return False
        with self._lock:
            return self._small.get(shape, False)


def no_shape(mm_hash: str) -> Shape | None:
    """Shapes unknown: every item is shared (`MMCACHE_SHARE_SMALL=on`; Dynamo's
    frontend turns the rule off with `hits_as_keys` instead)."""
    return None
