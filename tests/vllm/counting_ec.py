"""The mmcache EC connector, counting the vision encoder's calls for the tests.

    --ec-transfer-config '{"ec_connector": "CountingECConnector",
        "ec_connector_module_path": "tests.vllm.counting_ec", ...}'

The worker side wraps the tiny Qwen2-VL's vision tower so that each image it
encodes (a call may batch several: one row of `grid_thw` each) appends a line
to the file named by MMCACHE_TEST_ENCODER_CALLS: a count of encoder runs that
does not rely on the connector's own counters.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

from mmcache.client.vllm.connector import MMCacheECConnector


class CountingECConnector(MMCacheECConnector):
    def __init__(self, vllm_config: Any, role: ECConnectorRole) -> None:
        super().__init__(vllm_config, role)
        if role == ECConnectorRole.WORKER:
            _count_vision_calls(os.environ["MMCACHE_TEST_ENCODER_CALLS"])


def _count_vision_calls(path: str) -> None:
    from vllm.model_executor.models.qwen2_vl import Qwen2VisionTransformer

    forward = Qwen2VisionTransformer.forward
    if getattr(forward, "counted", False):
        return

    @functools.wraps(forward)
    def counted(self: Any, x: Any, grid_thw: Any, *args: Any, **kwargs: Any) -> Any:
        images = 1 if grid_thw is None else len(grid_thw)
        with open(path, "a", encoding="utf-8") as file:
            file.write("image\n" * images)
        return forward(self, x, grid_thw, *args, **kwargs)

    counted.counted = True  # type: ignore[attr-defined]
    Qwen2VisionTransformer.forward = counted  # type: ignore[method-assign]
