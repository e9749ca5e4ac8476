"""The EC connector's scheduler and worker sides, stepped as vLLM's scheduler
and model runner step them, on vLLM's own config, request and output classes
and a real sidecar. No engine: this runs in every vLLM environment, 0.33's
CUDA-only wheel included. The engines themselves: tests/vllm/test_ec.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from vllm.config import DeviceConfig, ECTransferConfig, ModelConfig, VllmConfig
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.v1.outputs import ECConnectorOutput
from vllm.v1.request import Request

from mmcache.client.vllm.connector import MMCacheECConnector, MMCacheECMetadata, WrongRoleError

from .conftest import Sidecar
from .test_caches import eventually
from .test_ec import needs_the_ec_interface
from .tiny_model import build

EMBEDS = 16
pytestmark = needs_the_ec_interface


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("model") / "tiny-qwen2-vl")


@pytest.fixture
def sides(
    model: Path, sidecar: Sidecar, tmp_path: Path
) -> Iterator[tuple[MMCacheECConnector, MMCacheECConnector]]:
    config = VllmConfig(
        model_config=ModelConfig(model=str(model)),
        device_config=DeviceConfig(device="cpu"),
        ec_transfer_config=ECTransferConfig(
            ec_connector="MMCacheECConnector",
            ec_connector_module_path="mmcache.client.vllm.connector",
            ec_role="ec_both",
            ec_connector_extra_config={"target": sidecar.target, "staging_dir": str(tmp_path)},
        ),
    )
    scheduler = MMCacheECConnector(config, ECConnectorRole.SCHEDULER)
    worker = MMCacheECConnector(config, ECConnectorRole.WORKER)
    yield scheduler, worker
    scheduler.shutdown()


def image_request(request_id: str, identifier: str) -> Request:
    feature = MultiModalFeatureSpec(
        data=None,
        modality="image",
        identifier=identifier,
        mm_position=PlaceholderRange(offset=1, length=EMBEDS),
        mm_hash=identifier,
    )
    return Request(
        request_id,
        [0] * (EMBEDS + 2),
        SamplingParams(max_tokens=1),
        None,
        mm_features=[feature],
    )


def test_an_output_one_engine_saved_is_staged_and_loaded_by_the_next(
    sides: tuple[MMCacheECConnector, MMCacheECConnector],
) -> None:
    scheduler, worker = sides
    output = torch.randn(EMBEDS, 32)
    worker.save_caches({"img": output}, "img")  # engine A's step encoded it
    counts: dict[str, int] = {}

    def saved() -> bool:
        meta = worker.build_connector_worker_meta()  # what a step sends back
        for name, n in meta.counts.items() if meta is not None else ():
            counts[name] = counts.get(name, 0) + n
        return counts.get("saved", 0) == 1

    eventually(saved)
    request = image_request("r1", "img")
    deadline = time.monotonic() + 5
    while not scheduler.ensure_cache_available(request, 0):  # the read, then the staging
        assert time.monotonic() < deadline, "the read never settled"
        time.sleep(0.01)
    assert scheduler.has_cache_item("img")
    scheduler.update_state_after_alloc(request, 0)
    meta = scheduler.build_connector_meta(scheduler_output=None)
    assert isinstance(meta, MMCacheECMetadata) and [m.identifier for m in meta.loads] == ["img"]
    worker.bind_connector_metadata(meta)
    encoder_cache: dict[str, torch.Tensor] = {}
    worker.start_load_caches(encoder_cache)
    worker.clear_connector_metadata()
    assert torch.equal(encoder_cache["img"], output)
    scheduler.update_connector_output(
        ECConnectorOutput(ec_connector_worker_meta=worker.build_connector_worker_meta())
    )
    scheduler.request_finished(request)
    assert scheduler.connector_scheduler is not None
    assert "img" not in scheduler.connector_scheduler.staging  # loaded: the staged copy goes
    assert scheduler.take_unavailable_requests() == set()


def test_an_output_the_sidecar_lacks_is_encoded_and_nothing_is_promised(
    sides: tuple[MMCacheECConnector, MMCacheECConnector],
) -> None:
    scheduler, _ = sides
    request = image_request("r2", "never-saved")
    deadline = time.monotonic() + 5
    while not scheduler.ensure_cache_available(request, 0):
        assert time.monotonic() < deadline, "the read never settled"
        time.sleep(0.01)
    assert not scheduler.has_cache_item("never-saved")  # vLLM encodes it
    assert scheduler.build_connector_meta(scheduler_output=None).loads == []
    assert scheduler.take_unavailable_requests() == set()  # no request fails for it


def test_each_role_holds_its_own_part_and_refuses_the_others_methods(
    sides: tuple[MMCacheECConnector, MMCacheECConnector],
) -> None:
    scheduler, worker = sides
    assert scheduler.connector_scheduler is not None and scheduler.connector_worker is None
    assert worker.connector_worker is not None and worker.connector_scheduler is None
    with pytest.raises(WrongRoleError, match="save_caches is the worker's"):
        scheduler.save_caches({"img": torch.zeros(EMBEDS, 32)}, "img")
    with pytest.raises(WrongRoleError, match="has_cache_item is the scheduler's"):
        worker.has_cache_item("img")
    with pytest.raises(WrongRoleError, match="build_connector_meta is the scheduler's"):
        worker.build_connector_meta(scheduler_output=None)
    assert worker.get_ec_connector_stats() is None  # a worker's counts go back in its metadata
    worker.shutdown()  # a worker has nothing to close


def test_the_former_module_paths_still_load_the_same_names() -> None:
    import mmcache.client.vllm as package
    import mmcache.client.vllm_ec as former_ec
    import mmcache.client.vllm_plugin as former_plugin

    assert former_ec.MMCacheECConnector is MMCacheECConnector
    assert former_plugin.register is package.register
