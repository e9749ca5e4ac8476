"""P0's lookups: which of a request's items are hits (`is_cached`), and each
hit as vLLM alone's cache would hand it over (`take`).

- The mirror names the candidates (behind a sidecar with an L2 tier, every
  item is one: another node's sidecar may hold it). Those resident in the
  sidecar's shared memory are leased there, on vLLM's thread, with no call
  (client/_resident.py), their prompt updates this process's own or the
  metadata stored with them in the region; one `lookup` round trip confirms
  the rest with the server, leases them for the engine's read (hits only)
  and brings the prompt updates of those this process never processed.
  A candidate whose upload is still in flight (another API process's) is
  waited for at most about what processing it here takes (this process's
  processor time per item, measured on its own requests): past that it is
  processed here, so a slow upload elsewhere never stalls this process's
  requests, which vLLM processes on one thread.
  Only confirmed hits with usable prompt updates are cached: vLLM skips the
  processor for them and sends no data, and the engine's read finds them.
- Single flight (`P0Context.single_flight`: several API processes on one
  sidecar): an item that neither the mirror nor this process's cache knows is
  asked about too, in the same call, and the server claims what it lacks for
  this process, which processes it and uploads it. Another process that asks
  for it meanwhile waits for that upload, up to the server's bound (0.5 s)
  rather than its own processing time: the claimer began first, so its
  upload normally ends sooner than a processing here would. So a new image
  is processed once, not once per process that sees it before its upload
  ends. The cost: one round trip on requests with a new image; the claim is
  the server's alone (not on the feed), and ends with any upload of the
  item or with its time (`claim_s`).
  A server that does not answer in time confirms nothing (fail-open).
- A small hit (under 1 MiB: uploaded over gRPC, outside the sidecar's shared memory) that
  `_fill` just read into this process's cache goes to the engine inline,
  rather than be read again by a call on the engine's thread (`_go_inline`);
  one this process's cache holds already is not asked about at all: it goes
  inline from there, as vLLM's processor-only cache sends it, with no call
  (`_held_small`).
- This process's own cache (`LocalCache`, _local.py): vLLM's own LRU of the
  same memory, told every call vLLM alone would make on its cache, with the
  data. What it holds and the sidecar does not (a sidecar slow, full or
  down) is a hit too, with no call: the item goes inline to the engine, as
  vLLM's processor-only cache sends it. A hit the sidecar answered that this
  cache lacks is read from the sidecar into it (`_fill`) before it counts;
  if the read fails it is a miss, as it is for vLLM alone, whose cache lacks
  it too. So every hit of vLLM alone is a hit here: docs/vllm.md.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.multimodal.cache import MultiModalCacheMissError

from mmcache._errors import MMCacheError
from mmcache.client.colocated import SHM_MIN_BYTES

from ._ledger import Ledger
from ._local import LocalCache
from ._p0_context import P0Context
from .convert import decode_updates, item_nbytes, to_vllm

__all__ = ["Lookup"]

_LOGGER = logging.getLogger(__name__)

CLAIM_MARGIN_S = 1.0  # a claim's time past three processings: the upload's
# Uploads under this go over gRPC, outside the sidecar's shared memory (but a
# small image's: _small.py), so the engine's read of one is a call: such a
# hit just read here goes inline.
INLINE_BELOW_BYTES = SHM_MIN_BYTES


class Lookup:
    """The hits of a P0 cache on its sidecar and on its own cache `own`."""

    def __init__(self, context: P0Context, own: LocalCache) -> None:
        self._p0 = context
        self._own = own
        # Hits smaller than this just read here go inline (0: none do).
        self._inline_bytes = INLINE_BELOW_BYTES
        self._keep_small = True  # small images stay here (_small.py)

    def hits_as_keys(self) -> None:
        """Every sidecar hit goes as its key, whatever its size, and every
        item is shared: for a transport that carries keys to a worker that
        reads them (Dynamo's)."""
        self._inline_bytes = 0
        self._keep_small = False

    def ask(self, ledger: Ledger, mm_hashes: list[str]) -> None:
        """Confirm, into `ledger`, which of `mm_hashes` are hits."""
        client = self._p0.sync.client
        keys = [self._p0.key(h) for h in mm_hashes]
        # vLLM may ask more than once per request: each hash is looked up once.
        # Behind a shared tier (L2) the mirror's "no" is not the fleet's: every
        # hash is asked about (the server reads the tier through), in the same call.
        # Only items named by their content (vLLM's digest, not a client's uuid)
        # are the fleet's: the others stay in this process's cache (_digests.py).
        # Small images are kept here as vLLM alone keeps them (_small.py),
        # but one this request asked about (maybe claimed) before another
        # request taught this process its shape: its upload follows.
        if self._keep_small:
            ledger.kept.update(
                h for h in mm_hashes if h not in ledger.looked_up and self._p0.small.is_small(h)
            )
        if ledger.kept and self._p0.single_flight:
            self._kept_from_region(ledger, mm_hashes, keys)
        shared = [self._p0.shareable(h) and h not in ledger.kept for h in mm_hashes]
        if client.shared_tier and client.following:  # (not while out of touch)
            known = shared
        else:
            held = client.is_cached(keys, pending=True)
            known = [h and s for h, s in zip(held, shared, strict=True)]
        unasked = [
            i
            for i, h in enumerate(mm_hashes)
            if h not in ledger.looked_up and h not in ledger.local
        ]
        # Held here and small: its hit goes inline from here, asked of no one.
        candidates = [
            i for i in unasked if known[i] and not self._held_small(ledger, mm_hashes[i], keys[i])
        ]
        claim = False
        if self._p0.single_flight and client.following and self._p0.known.undescribed is None:
            # New here and to the mirror: asked too, and claimed where missing.
            new = [
                i
                for i in unasked
                if not known[i] and shared[i] and not self._own.is_cached_item(mm_hashes[i])
            ]
            candidates = sorted(candidates + new)
            # Claimed where the server lacks them (it claims nothing it holds
            # or is being sent): the new, and any the mirror named that this
            # process's cache lacks, so that a mirror behind the server (an
            # eviction, an upload elsewhere that failed) keeps single flight.
            # (Behind an L2 tier every item is a candidate: only the new, none.)
            claim = bool(new) or (
                not client.shared_tier
                and any(not self._own.is_cached_item(mm_hashes[i]) for i in candidates)
            )
        ask = candidates
        if self._p0.known.undescribed is not None:
            # Updates that cannot travel: only what this process processed can
            # hit here; the rest is processed, and not uploaded again.
            ask = [i for i in candidates if self._p0.known.get(mm_hashes[i]) is not None]
            ledger.held_elsewhere.update(mm_hashes[i] for i in candidates if i not in ask)
        if ask:
            try:
                ask = self._lease_resident(ledger, mm_hashes, keys, ask)
            except MMCacheError as exc:  # a hash no server takes: the lookup says so
                _LOGGER.debug("mmcache lease with no call failed: %s", exc)
        if ask:
            self._look_up(ledger, mm_hashes, keys, ask, claim)
        # What the sidecar did not confirm (slow, full, down, never sent it)
        # and this process's own cache holds is a hit all the same.
        self._own_hits(ledger, mm_hashes, known)
        self._fill(ledger, mm_hashes, keys)
        self._go_inline(ledger, mm_hashes, keys)

    def _kept_from_region(self, ledger: Ledger, mm_hashes: list[str], keys: list[str]) -> None:
        """Small images kept here that another API process shared through the
        sidecar's shared memory (_small.py): leased there with no call, and
        read there by the engine, with no call either. One not resident
        there, or held by this process's own cache, is this process's alone,
        as vLLM alone's: no call is made for it. The region's index is asked,
        not the mirror: an icon posted a moment ago is there before the
        feed says so (a probe of a hash not there writes nothing)."""
        own = self._own
        ask = [
            i
            for i, h in enumerate(mm_hashes)
            if h in ledger.kept
            and h not in ledger.looked_up
            and self._p0.shareable(h)
            and not own.is_cached_item(h)
        ]
        if ask:
            try:
                self._lease_resident(ledger, mm_hashes, keys, ask)
            except MMCacheError as exc:
                _LOGGER.debug("mmcache lease with no call failed: %s", exc)

    def _own_hits(self, ledger: Ledger, mm_hashes: list[str], known: list[bool]) -> None:
        """This process's cache's hits the sidecar did not confirm: kept for the
        request (their data goes inline); those the sidecar lacks are offered
        to it again. The sidecar's hits go first: the engine reads those with
        no data sent, as vLLM alone's one-API-server hits send none."""
        for mm_hash, held in zip(mm_hashes, known, strict=True):
            if ledger.is_hit(mm_hash):
                continue
            # Held here, and not in the sidecar by its mirror or its answer just now.
            if (
                self._take_own(ledger, mm_hash)
                and (not held or mm_hash in ledger.looked_up)
                and self._p0.known.undescribed is None
                and self._p0.shareable(mm_hash)
                and mm_hash not in ledger.kept
            ):
                ledger.unshared.add(mm_hash)

    def _take_own(self, ledger: Ledger, mm_hash: str) -> bool:
        """This process's cache's entry for `mm_hash`, taken for the request
        (an eviction meanwhile cannot turn the hit into a miss); False where
        it holds none usable. An injected item (inject_into_mm_cache gives
        none) has no prompt updates to apply: a processor's hit on it would
        fail the request, as it would in vLLM alone, so it is processed again."""
        entry = self._own.peek(mm_hash)
        if entry is None or not entry[1]:
            return False
        ledger.local[mm_hash] = entry
        return True

    def _fill(self, ledger: Ledger, mm_hashes: list[str], keys: list[str]) -> None:
        """The sidecar's hits this process's cache lacks are read into it, as
        vLLM alone would have cached them on processing them here; their
        leases stay for the engine. Where the read fails they are misses, as
        they are for vLLM alone, whose cache lacks them too."""
        own, need = self._own, []
        for i, h in enumerate(mm_hashes):
            if h in ledger.confirmed and h not in ledger.filled and h not in ledger.here:
                entry = own.peek(h)
                if entry is not None:
                    ledger.here[h] = entry
                else:
                    need.append(i)
        if not need:
            return
        client, wanted = self._p0.sync.client, [keys[i] for i in need]
        try:
            items = client.fetch_resident(wanted, release=False)
            if items is None:
                items = self._p0.sync.call(client.fetch(wanted, release=False))
        except MMCacheError as exc:
            _LOGGER.debug("mmcache read into this process's cache failed: %s", exc)
            for i in need:
                del ledger.confirmed[mm_hashes[i]]
            leased = [keys[i] for i in need if mm_hashes[i] in ledger.leased]
            if leased:
                self._p0.sync.submit(client.release(leased))
            return
        for i, stored in zip(need, items, strict=True):
            ledger.filled[mm_hashes[i]] = to_vllm(stored)

    def _go_inline(self, ledger: Ledger, mm_hashes: list[str], keys: list[str]) -> None:
        """The sidecar's small hits just read into this process's cache go to
        the engine inline, as vLLM's processor-only cache sends its hits: the
        engine's read of an item the sidecar keeps outside its shared memory
        would be a call on the engine's thread, for data that is here. (A
        small hit this process held before is asked of no one: `_held_small`.
        The read here moved it into the sidecar's shared memory, where other
        processes' hits of it cost no call.) Their leases, where the lookup
        took any, are given back in one call, in the background."""
        if not self._inline_bytes:
            return
        leased: list[str] = []
        for mm_hash, key in zip(mm_hashes, keys, strict=True):
            data = ledger.filled.get(mm_hash)
            if data is None or mm_hash in ledger.resident or mm_hash in ledger.inline:
                continue
            if item_nbytes(data) >= self._inline_bytes:
                continue
            ledger.inline.add(mm_hash)
            if mm_hash in ledger.leased:
                ledger.leased.discard(mm_hash)
                leased.append(key)
        if leased:
            self._p0.sync.submit(self._p0.sync.client.release(leased))

    def _held_small(self, ledger: Ledger, mm_hash: str, key: str) -> bool:
        """Whether a hit on `mm_hash` goes inline from this process's own cache,
        with no lookup: held there with its prompt updates (taken for the
        request now, so an eviction meanwhile cannot turn it into a miss),
        and under the inline bound by the mirror's size. The sidecar keeps
        such an item outside its shared memory, so confirming it would be a
        lookup call (about 0.55 ms of the API process's CPU and 0.7 ms of the
        sidecar's), where sending the data is a copy of under 1 MiB, as vLLM's
        processor-only cache sends its hits (and, with one API server, the
        engine keeps it: _receiver.py). Counted on the sidecar as an own hit
        (the report ring); its touch rides this process's next batch."""
        return self._small(key) and self._take_own(ledger, mm_hash)

    def _small(self, key: str) -> bool:
        """Under the inline bound by the mirror's size (none is where no hit goes inline)."""
        if not self._inline_bytes:
            return False
        size = self._p0.sync.client.mirror.size_of(key)
        return size is not None and size < self._inline_bytes

    def _goes_inline(self, mm_hash: str, key: str) -> bool:
        """Whether a hit on `mm_hash` would go inline, judged before the lookup:
        not in this process's cache (so read into it), and small by the
        mirror's size. Where every hit of a call would, it takes no leases."""
        return not self._own.is_cached_item(mm_hash) and self._small(key)

    def _look_up(
        self, ledger: Ledger, mm_hashes: list[str], keys: list[str], ask: list[int], claim: bool
    ) -> None:
        """Ask the server about the hashes at `ask` (one call): those held with
        updates usable here are confirmed; a failure leaves them misses.
        `claim`: those it lacks are claimed for this process (single flight)."""
        client = self._p0.sync.client
        try:
            # Waiting for an upload in flight elsewhere saves a processing
            # only for an item this process's own cache lacks.
            own = self._own
            lacked = sum(not own.is_cached_item(mm_hashes[i]) for i in ask)
            wait_s = self._p0.processing.wait_for(lacked)
            # Held until this process's upload of them ends: its processing
            # and the upload, with room for a slow one (the server caps it).
            claim_s = CLAIM_MARGIN_S + 3 * self._p0.processing.per_item * lacked if claim else 0.0
            # Leased for the engine's read, unless every hit goes inline (the
            # read into this process's cache follows the lookup at once).
            lease = not all(self._goes_inline(mm_hashes[i], keys[i]) for i in ask)
            found = self._p0.sync.call(
                client.lookup(
                    [keys[i] for i in ask],
                    want_metadata=True,
                    lease="hits" if lease else False,
                    wait_s=wait_s,
                    claim_s=claim_s,
                )
            )
        except MMCacheError as exc:
            _LOGGER.debug("mmcache lookup failed, items are misses: %s", exc)
            return
        unusable: list[str] = []
        for i, held, blob in zip(ask, found.held, found.metadata, strict=True):
            mm_hash = mm_hashes[i]
            ledger.looked_up.add(mm_hash)
            if not held:
                continue
            updates = self._p0.known.get(mm_hash)
            if updates is None and blob is not None:
                updates = decode_updates(blob)
            if updates is None:  # held, but not usable here: process it
                if lease:
                    unusable.append(keys[i])
                continue
            ledger.confirmed[mm_hash] = updates
            if lease:
                ledger.leased.add(mm_hash)
        if unusable:
            self._p0.sync.submit(client.release(unusable))

    def _lease_resident(
        self, ledger: Ledger, mm_hashes: list[str], keys: list[str], ask: list[int]
    ) -> list[int]:
        """Confirm with no call, on this thread, the hits resident in the
        sidecar's shared memory whose prompt updates this process knows, or
        can read from the metadata stored with them; the rest of `ask`, to
        look up by call."""
        updates: dict[int, Any] = {}

        def usable(j: int, metadata: bytes) -> bool:
            known = self._p0.known.get(mm_hashes[ask[j]])
            if known is None and metadata and self._p0.known.undescribed is None:
                known = decode_updates(metadata)
            if known is not None:
                updates[j] = known
            return known is not None

        leased = self._p0.sync.client.lease_resident([keys[i] for i in ask], usable=usable)
        for j, held in enumerate(leased.held):
            if held:
                mm_hash = mm_hashes[ask[j]]
                ledger.looked_up.add(mm_hash)
                ledger.confirmed[mm_hash] = updates[j]
                ledger.leased.add(mm_hash)
                ledger.resident.add(mm_hash)
        return [i for i in ask if mm_hashes[i] not in ledger.confirmed]

    def take(self, ledger: Ledger, mm_hash: str) -> tuple[Any, Any]:
        """A hit `ask` confirmed, on this process's cache as vLLM alone's
        would take it: the sidecar's (None: the engine reads it there; a small
        one just read into this process's cache goes inline), or this
        process's own (its data inline; offered to a sidecar that lacks it)."""
        updates = ledger.confirmed.get(mm_hash)
        if updates is not None:
            filled = ledger.filled.get(mm_hash)
            # vLLM alone's read of a hit (reordering); one this request's own
            # misses evicted since is_cached goes back, its data at hand.
            taken = ledger.here.get(mm_hash) if filled is None else (filled, updates)
            if taken is not None or self._own.is_cached_item(mm_hash):
                self._own.get_and_update_item(taken, mm_hash)
            # Small and read here: its data goes, the engine reads nothing.
            return (filled if mm_hash in ledger.inline else None), updates
        entry = ledger.local.get(mm_hash)
        if entry is None:  # vLLM sends None only where is_cached said True
            raise MultiModalCacheMissError([mm_hash])
        # vLLM's own read (reordering); the entry taken at is_cached if evicted since.
        item, updates = self._own.get_and_update_item(entry, mm_hash)
        modality = next((u.modality for u in updates), None) or "unknown"
        if mm_hash not in ledger.looked_up:
            ledger.own_hits.append(modality)
        if mm_hash in ledger.unshared:
            ledger.unshared.discard(mm_hash)
            ledger.offered.add(mm_hash)
            ledger.uploads.append((mm_hash, modality, item, updates))
        return item, updates
