"""The plugin on each vLLM release it supports (0.31, 0.32, 0.33), against that
release's own classes, with a real server; and a release it does not know.

vLLM 0.33's P0 asks `is_cached_item` on its output loop, of the hashes the
engine found missing, before it queues their `invalidate`; it checks items a
client supplied processed (`validate_input_item`) and closes the cache at
shutdown. These run in every vLLM environment, 0.33's included (its wheel is
CUDA-only: the classes, not an engine).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from types import SimpleNamespace

import pytest
from vllm.config import MultiModalConfig

from mmcache.client.vllm import scope_of
from mmcache.client.vllm._caches import MMCacheProcessorCache
from mmcache.client.vllm._releases import PLUGIN_RELEASES, refusal, release_of
from mmcache.client.vllm.runtime import SyncClient

from .conftest import Sidecar
from .serve import metrics
from .test_caches import SCOPE, clients, eventually, item, request  # noqa: F401  (a fixture)


def served(sidecar: Sidecar) -> dict[str, float]:
    return metrics(f"http://127.0.0.1:{sidecar.metrics_port}/metrics")


def test_is_cached_item_asks_the_mirror_alone_and_invalidate_forgets(
    clients: Callable[[], SyncClient],  # noqa: F811
    sidecar: Sidecar,
) -> None:
    p0 = MMCacheProcessorCache(clients(), SCOPE)
    request(p0, [("red", item(1))])
    eventually(lambda: p0.is_cached_item("red"))
    before = served(sidecar)
    # As vLLM 0.33's output loop asks, from a thread no request runs on.
    assert p0.is_cached_item("red") and not p0.is_cached_item("blue")
    after = served(sidecar)
    assert after["mmcache_queries_total"] == before["mmcache_queries_total"]  # no call
    assert after["mmcache_leases"] == 0  # nothing held for an engine that will not read
    assert p0.make_stats().total == 1  # and no query counted for vLLM
    p0.invalidate("red")
    assert not p0.is_cached_item("red")


def test_an_item_whose_hash_no_server_takes_is_refused_before_the_engine(
    clients: Callable[[], SyncClient],  # noqa: F811
) -> None:
    p0 = MMCacheProcessorCache(clients(), SCOPE)
    p0.validate_input_item(item(1), "a" * 64)
    with pytest.raises(ValueError, match="characters long; the limit is"):
        p0.validate_input_item(item(1), "a" * 100_000)


def test_close_lets_the_uploads_in_flight_end_and_starts_none(
    clients: Callable[[], SyncClient],  # noqa: F811
    sidecar: Sidecar,
) -> None:
    p0 = MMCacheProcessorCache(clients(), SCOPE)
    request(p0, [("before", item(1, numel=1 << 20))])  # 4 MiB, uploaded in the background
    started = time.monotonic()
    p0.close()
    assert time.monotonic() - started < p0.sync.deadline_s + 0.5
    assert p0.uploads_in_flight == 0
    assert p0.sync.client.is_cached([p0.key("before")], pending=True) == [True]
    received = served(sidecar)["mmcache_received_bytes_total"]
    (out,) = request(p0, [("after", item(2))])
    assert out[0] is not None  # still served, inline
    time.sleep(0.3)
    assert served(sidecar)["mmcache_received_bytes_total"] == received  # nothing uploaded


def test_the_hasher_is_part_of_the_key_scope() -> None:
    def config(algorithm: str) -> SimpleNamespace:
        multimodal = MultiModalConfig(mm_hasher_algorithm=algorithm)
        model = SimpleNamespace(model="m", get_multimodal_config=lambda: multimodal)
        return SimpleNamespace(model_config=model)

    assert scope_of(config("blake3")) == scope_of(config("blake3"))
    assert scope_of(config("blake3")) != scope_of(config("sha256"))


def test_releases_are_known_by_major_and_minor() -> None:
    assert release_of("0.33.1.dev3+g1a2b3c") == (0, 33)
    assert release_of("0.31.0+cpu") == (0, 31)
    assert release_of("main") is None
    assert refusal("it", "0.32.0", PLUGIN_RELEASES, untested=False) is None
    why = refusal("it", "0.34.0", PLUGIN_RELEASES, untested=False)
    assert why is not None and "vLLM 0.34.0 (tested: 0.31, 0.32, 0.33)" in why
    assert refusal("it", "0.34.0", PLUGIN_RELEASES, untested=True) is None


# In a process of its own: register() replaces vLLM's cache factories there.
_REGISTER = """
import logging
logging.basicConfig(format="%(levelname)s %(message)s")
import vllm
import vllm.multimodal.cache.factories as factories
own = factories.processor_cache_from_config
vllm.__version__ = {version!r}
from mmcache.client.vllm import register
register()
print("mmcache" if factories.processor_cache_from_config is not own else "vllm")
"""


@pytest.mark.parametrize(
    ("version", "untested", "expected"),
    [("this", "", "mmcache"), ("0.99.0", "", "vllm"), ("0.99.0", "1", "mmcache")],
)
def test_a_release_it_was_not_tested_with_turns_the_plugin_off_with_an_error(
    version: str, untested: str, expected: str
) -> None:
    import vllm

    if version == "this":
        version = str(vllm.__version__)
    env = {**os.environ, "MMCACHE_TARGET": "127.0.0.1:1", "MMCACHE_VLLM_UNTESTED": untested}
    done = subprocess.run(
        [sys.executable, "-c", _REGISTER.format(version=version)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == expected
    refused = "not tested with vLLM 0.99.0 (tested: 0.31, 0.32, 0.33)" in done.stderr
    assert refused == (expected == "vllm"), done.stderr[-2000:]
    if refused:
        assert "ERROR mmcache's vLLM plugin was not tested" in done.stderr
