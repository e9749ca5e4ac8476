"""Fetch and ReadShm replies decoded into items: from chunk frames, copied
out of the shared-memory region, or viewed in place."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from mmcache._errors import InvalidArgumentError
from mmcache._items import Item

from ._codec import ItemDecoder, view_item
from ._pool import BufferPool
from .wire import Fetched, Slot, parse_fetched

if TYPE_CHECKING:  # (the region's reads use this module)
    from .colocated import ClientRegion

__all__ = ["ShmRace", "decode_items", "no_frames", "read_fetch"]


class ShmRace(Exception):
    """An extent was freed while its bytes were copied: read again over gRPC."""


async def no_frames() -> AsyncIterator[bytes]:
    """A ReadShm reply's frames: none (every item is in a slot)."""
    return
    yield


async def read_fetch(
    frames: AsyncIterator[bytes], expected: int, pool: BufferPool | None = None
) -> list[Item]:
    """The items of a Fetch reply."""
    # The transport gives the header's bytes first, wherever they travelled.
    return await decode_items(parse_fetched(await anext(frames)), frames, expected, pool)


async def decode_items(
    header: Fetched,
    frames: AsyncIterator[bytes],
    expected: int,
    pool: BufferPool | None = None,
    region: ClientRegion | None = None,
    views: list[Slot] | None = None,
) -> list[Item]:
    """The items a reply's header names. Items in the region are copied out of
    `region`; or, given `views`, viewed in place, their extents added to `views`
    (the caller gives their holds back); the rest from chunk frames."""
    if len(header.items) != expected:
        raise InvalidArgumentError("the Fetch reply names a different number of items")
    items: list[Item] = []
    for fetched in header.items:
        # Each frame is copied into the item's tensors as it arrives and dropped.
        slot = fetched.slot
        if slot is not None and views is not None and region is not None:
            try:
                items.append(view_item(fetched.spec, region.view(slot)))
            except ValueError as exc:
                raise InvalidArgumentError(f"the Fetch reply's slot: {exc}") from None
            views.append(slot)
            continue
        decoder = ItemDecoder(fetched.spec, pool)
        if slot is not None:
            if region is None:
                raise InvalidArgumentError("the Fetch reply names a slot this client cannot map")
            try:
                copied = region.read(slot, decoder)
            except ValueError as exc:
                raise InvalidArgumentError(f"the Fetch reply's slot: {exc}") from None
            if not copied:
                raise ShmRace
        for index in range(fetched.num_chunks):
            frame = await anext(frames, None)
            if frame is None:
                raise InvalidArgumentError(
                    f"the Fetch reply ended after {index} of the {fetched.num_chunks} chunk "
                    f"frames of {fetched.mm_hash!r}"
                )
            decoder.feed(frame)
        items.append(decoder.finish())
    # Read to the end so the call completes with its status: a call left
    # open would be cancelled, and grpc keeps a cancelled call (and its
    # buffers) alive until the garbage collector runs.
    if await anext(frames, None) is not None:
        raise InvalidArgumentError("the Fetch reply carries more frames than its header declares")
    return items
