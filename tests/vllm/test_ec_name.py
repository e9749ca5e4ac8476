"""The EC connector named alone in vLLM's configuration: the plugin registers
it with vLLM's connector factory (idempotently), and the module path still
works."""

from __future__ import annotations

import pytest

from mmcache.client.vllm import register
from mmcache.client.vllm._ec_name import CONNECTOR_CLASS, register_ec_connector
from mmcache.client.vllm.connector import MMCacheECConnector

factory = pytest.importorskip("vllm.distributed.ec_transfer.ec_connector.factory")
ec_transfer = pytest.importorskip("vllm.config.ec_transfer")


def test_the_connector_is_found_by_its_name_alone_and_by_its_module_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("MMCACHE_TARGET", raising=False)  # registered even when inert
    register()
    register()  # vLLM may load general plugins more than once in a process
    assert register_ec_connector()
    by_name = ec_transfer.ECTransferConfig(ec_connector=CONNECTOR_CLASS, ec_role="ec_both")
    assert factory.ECConnectorFactory.get_connector_class(by_name) is MMCacheECConnector
    by_path = ec_transfer.ECTransferConfig(
        ec_connector=CONNECTOR_CLASS,
        ec_connector_module_path="mmcache.client.vllm.connector",
        ec_role="ec_both",
    )
    assert factory.ECConnectorFactory.get_connector_class(by_path) is MMCacheECConnector
