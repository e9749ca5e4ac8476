"""docs/metrics.md documents exactly what a live server exports."""

from __future__ import annotations

import re
from pathlib import Path

from .conftest import connected, scrape, serving, store_of
from .items import image_item

DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"
_SUFFIXES = ("_bucket", "_sum", "_count")


def documented() -> set[str]:
    return set(re.findall(r"^\| `([a-z0-9_]+)` \|", DOC.read_text(), flags=re.MULTILINE))


def family(name: str) -> str:
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name


async def test_every_exported_metric_is_documented_and_every_documented_one_exported() -> None:
    async with serving(capacity_bytes=64 << 10) as server:
        # No feed: the mirror does not hear of the Clear below.
        async with connected(server, follow=False) as client:
            # Exercise every labelled series: queries, hits, re-sends, uncached, books.
            item = image_item(1)
            await client.get_and_update([item], ["a"], lease=False)
            await client.get_and_update([item], ["a"], lease=False)
            store_of(server).clear()  # the mirror still believes: the next call re-sends
            await client.get_and_update([item], ["a"])
            await client.get_and_update([image_item(2, numel=100_000)], ["too-big"])
            async with connected(server) as follower:
                await follower.wait_following()  # a feed snapshot
            book = client.encoder_cache("engine-0")
            await book.create(cache_size=100)
            await book.check_and_update_cache("r", "h")
            samples = await scrape(server.metrics_port)
    # Counters' `_created` companions are mentioned in the doc, not tabled.
    exported = {family(name) for name, _ in samples if not name.endswith("_created")}
    exported.discard("python_gc_objects_collected")  # none: the registry is our own
    assert exported == documented()
