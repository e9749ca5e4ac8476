"""Whether the small items the fleet stores are asked for again.

The vLLM plugin shares a small image (an icon: processing it costs about
what sharing it does) through the region with no call (docs/vllm.md). That
pays only where another process asks for it again: on traffic of small
images each sent once, every upload is CPU spent for nothing. The server is
the one place that sees both sides: every small item stored, and every hit
of one (a lookup's, or a lease taken in the region with no call, which its
client reports). So it judges, and the region tells co-located clients
(mmcache._shm_layout.ADVICE_AT).

The rule: sharing small items is *paused* while the last `STORES` small
items stored drew, in the time they took to come, fewer than one hit of a
small item per `PAUSE_HITS_PER` of them (fewer than 4 hits in the span of
the last 32 stores). Paused, a client still shares the small images whose
key falls in the one-in-`mmcache._shm_layout.SAMPLE_ONE_IN` sample (the
same in every process): those keep the measure going, unbiased, so reuse
that comes back ends the pause within a few sampled stores (no decision
feeds on its own outcome). A server with fewer than `STORES` small items
stored since it started never pauses. Worst case while paused: a small
image outside the sample is processed once in each process that asks for
it, as vLLM alone processes it (every process's own cache then hits it, as
vLLM alone's does); where reuse is spread over many images the measure
bounds that at about one processing per `PAUSE_HITS_PER` small images that
come. A hit is a lookup's, a lease taken in the region with no call, or an
upload of an item already held (two processes processed it at once).
"""

from __future__ import annotations

from collections import deque

from mmcache._shm_layout import SHM_MIN_BYTES

__all__ = ["PAUSE_HITS_PER", "SMALL_BYTES", "STORES", "SmallReuse"]

SMALL_BYTES = SHM_MIN_BYTES  # as the plugin's small images (client/vllm/_small.py)
STORES = 32  # the span judged: a traffic change shows within this many stores
PAUSE_HITS_PER = 8


class SmallReuse:
    """Stores of items under SMALL_BYTES, and their hits, over the span of the
    last STORES stores."""

    def __init__(self) -> None:
        # Per store of the span, the hits that came after it (and before the next).
        self._span: deque[int] = deque()
        self._hits = 0

    # An item of 0 bytes is none held (a lease of a key gone meanwhile): not counted.
    def stored(self, nbytes: int) -> None:
        if 0 < nbytes < SMALL_BYTES:
            span = self._span
            if len(span) == STORES:
                self._hits -= span.popleft()
            span.append(0)

    def hit(self, nbytes: int) -> None:
        if 0 < nbytes < SMALL_BYTES and self._span:
            self._span[-1] += 1
            self._hits += 1

    @property
    def paused(self) -> bool:
        """Whether small items drew too few hits to be worth sharing now."""
        return len(self._span) == STORES and self._hits * PAUSE_HITS_PER < STORES

    @property
    def hits_per_store(self) -> float:
        """The span's hits per small item stored (0 with none stored)."""
        return self._hits / len(self._span) if self._span else 0.0
