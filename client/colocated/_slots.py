"""Write slots for uploads through shared memory, with a few kept in reserve.

An upload through the region costs two calls: ShmAllocate for slots, then
GetAndUpdate naming them. A frontend uploads items of the same few sizes
over and over (images resized to the model's input), so each ShmAllocate
also asks for a few spare slots of the sizes it needed, and the next uploads
of those sizes use them; each such upload asks for the spares it used back
with its reply. In steady state an upload is one call, and a resident upload
of small items that leases nothing is none while spares last (posted in the
report ring, client/_uploads.py). Spares are leased like
any write slot: one that expired unused is dropped here, and the server
reuses its memory; a client that closes gives its spares back. They hold at
most SPARE_BYTES of the region per client, MAX_SPARES of one size (up to
MAX_SMALL_SPARES of a small one: SMALL_SPARE_BYTES of it).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Sequence

from ..wire import Slot
from ._shm import ClientRegion

__all__ = ["SPARE_BYTES", "Size", "WriteSlots", "size_of", "spares_of"]

SPARE_BYTES = 32 << 20
MAX_SPARES = 3  # of one size
# Smaller items keep more, up to this many bytes of one size: each spare
# is an upload posted with no call (client/_uploads.py), and the call that
# tops them up comes once per that many uploads.
MAX_SMALL_SPARES = 16
SMALL_SPARE_BYTES = 1 << 20
_ROOM_STEP = 512  # trailers round up to this: keys and specs of similar length share spares

Size = tuple[int, int]  # payload bytes, room after it for the key and spec


def size_of(payload: int, trailer: int) -> Size:
    return payload, -(-trailer // _ROOM_STEP) * _ROOM_STEP


def spares_of(size: Size) -> int:
    """The spares kept of one size: MAX_SPARES, more of small ones."""
    return max(MAX_SPARES, min(MAX_SMALL_SPARES, SMALL_SPARE_BYTES // sum(size)))


class WriteSlots:
    """The spare write slots of one client, by size, and those asked for.

    Uploads run concurrently, each asking for spares with its reply: what
    is asked is counted at once (`top_up`) and settled when the answer comes
    (`keep`), so the spares held and asked together stay within the caps;
    any that come beyond them are handed back to be given back to the server.
    Thread-safe: the client's loop tops spares up, and an upload posted from
    a caller's thread takes them (`take_spares`).
    """

    def __init__(self) -> None:
        self._spares: dict[Size, list[Slot]] = {}
        self._asked: Counter[Size] = Counter()
        self._closed = False
        self._lock = threading.Lock()

    def held(self, size: Size) -> int:
        """The spares of `size` kept now (some may have expired)."""
        return len(self._spares.get(size, ()))

    def take(self, region: ClientRegion, size: Size) -> Slot | None:
        """A live spare of `size`, if one is kept (expired ones are dropped)."""
        with self._lock:
            return self._take(region, size)

    def take_spares(self, region: ClientRegion, sizes: Sequence[Size]) -> list[Slot] | None:
        """A live spare of each of `sizes`, where each size keeps one more than
        it gives (the last of a size goes by call, whose reply brings spares
        back); None, and nothing taken, where one cannot be had."""
        wanted = Counter(sizes)
        with self._lock:
            if any(self.held(size) <= count for size, count in wanted.items()):
                return None
            slots = [self._take(region, size) for size in sizes]
            taken = [slot for slot in slots if slot is not None]
            if len(taken) == len(slots):
                return taken
            for slot, size in zip(slots, sizes, strict=True):  # expired: the rest kept
                if slot is not None:
                    self._spares[size].append(slot)
            return None

    def _take(self, region: ClientRegion, size: Size) -> Slot | None:
        spares = self._spares.get(size)
        while spares:
            slot = spares.pop()
            if region.live(slot):
                return slot
        return None

    def top_up(self, used: Sequence[Size]) -> list[Size]:
        """The spares to ask for after using slots of these sizes: enough to
        hold MAX_SPARES of each again, as far as the budget allows, counting
        those already asked for. Settle each ask with `keep`."""
        with self._lock:
            return self._top_up(used)

    def _top_up(self, used: Sequence[Size]) -> list[Size]:
        if self._closed:
            return []
        held = self._bytes()
        wanted: list[Size] = []
        for size in dict.fromkeys(used):
            count = spares_of(size) - len(self._spares.get(size, ())) - self._asked[size]
            count = max(0, min(count, (SPARE_BYTES - held) // sum(size)))
            wanted += [size] * count
            self._asked[size] += count
            held += count * sum(size)
        return wanted

    def keep(
        self, slots: Iterable[Slot], sizes: Sequence[Size], *, asked: bool = True
    ) -> list[int]:
        """Keep these slots of `sizes` as spares (`asked`: the answer to a
        `top_up`, all it brought, perhaps nothing); the leases of those beyond
        the caps, to give back."""
        with self._lock:
            return self._keep(slots, sizes, asked)

    def _keep(self, slots: Iterable[Slot], sizes: Sequence[Size], asked: bool) -> list[int]:
        if asked:
            self._asked.subtract(sizes)
            self._asked = +self._asked  # drop the sizes settled to 0
        held = self._bytes()
        surplus: list[int] = []
        for size, slot in zip(sizes, slots, strict=False):
            kept = self._spares.setdefault(size, [])
            if self._closed or len(kept) >= spares_of(size) or held + sum(size) > SPARE_BYTES:
                surplus.append(slot.lease)
                continue
            kept.append(slot)
            held += sum(size)
        return surplus

    def drain(self, *, close: bool = False) -> list[int]:
        """Every spare's lease (to give back), none kept any more; `close`:
        none kept from now on either (answers still to come are surplus)."""
        with self._lock:
            self._closed = self._closed or close
            leases = [slot.lease for slots in self._spares.values() for slot in slots]
            self._spares.clear()
            return leases

    def _bytes(self) -> int:
        """Bytes of the spares held and asked for."""
        held = sum(sum(size) * len(slots) for size, slots in self._spares.items())
        return held + sum(sum(size) * count for size, count in self._asked.items())
