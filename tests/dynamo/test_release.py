"""A Dynamo release the transport was not tested with: an ERROR, and Dynamo's
own transfer left as it is. And the sender's cleanup, on the response's path,
never waits for its sidecar (issue 43)."""

from __future__ import annotations

import importlib.metadata
import logging
import os
import signal
import sys
import time
import types
from pathlib import Path

import pytest

from mmcache.client.vllm import dynamo as transport
from mmcache.client.vllm.runtime import SyncClient
from tests.test_faults import DEADLINE_S, sidecar


def test_the_public_path_names_the_transport() -> None:
    from mmcache.client import dynamo

    assert (dynamo.install, dynamo.EXTRA_KEY) == (transport.install, transport.EXTRA_KEY)


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


def test_dynamos_cleanup_does_not_wait_for_the_release(tmp_path: Path) -> None:
    """A stopped sidecar (SIGSTOP): the release is fired in the background,
    and the response ends at once, not at the deadline or the client's 60 s."""
    with sidecar(tmp_path) as (proc, port):
        sync = SyncClient(f"127.0.0.1:{port}", deadline_s=DEADLINE_S)
        try:
            os.kill(proc.pid, signal.SIGSTOP)
            began = time.monotonic()
            transport._release(sync, ["held"])  # on the response's path
            assert time.monotonic() - began < 0.05
        finally:
            os.kill(proc.pid, signal.SIGCONT)
            sync.close()
