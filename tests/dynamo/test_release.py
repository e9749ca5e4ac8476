"""A Dynamo release the transport was not tested with: an ERROR, and Dynamo's
own transfer left as it is."""

from __future__ import annotations

import importlib.metadata
import logging
import sys
import types

import pytest

from mmcache.client import dynamo as transport


def test_an_untested_dynamo_release_keeps_dynamos_transfer_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from dynamo.frontend import vllm_processor
    from dynamo.vllm.multimodal_utils import request_processor

    assert importlib.metadata.version("ai-dynamo") in transport.TESTED_DYNAMO
    # As in Dynamo's processes: their main modules are loaded.
    for name in (transport.FRONTEND_MODULE, transport.WORKER_MODULE):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "1.7.0")
    init = vllm_processor.VllmProcessor.__init__
    receive = request_processor.VllmMultimodalRequestProcessor.try_receive_mm_kwargs
    with caplog.at_level(logging.ERROR):
        transport.install()
    assert vllm_processor.VllmProcessor.__init__ is init
    assert request_processor.VllmMultimodalRequestProcessor.try_receive_mm_kwargs is receive
    assert "Dynamo 1.7.0 is not a release mmcache's transport was tested with" in caplog.text
    assert "(tested: 1.6.1)" in caplog.text
