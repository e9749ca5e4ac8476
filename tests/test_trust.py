"""What an operator is told about exposing the server."""

from __future__ import annotations

import logging

import pytest

from mmcache.server import MMCacheServer

from .conftest import server_config


@pytest.mark.parametrize(("host", "warned"), [("0.0.0.0", True), ("127.0.0.1", False)])
async def test_a_bind_beyond_loopback_without_protection_is_warned_of(
    caplog: pytest.LogCaptureFixture, host: str, warned: bool
) -> None:
    with caplog.at_level(logging.WARNING, logger="mmcache.server._app"):
        async with MMCacheServer(server_config(host=host)):
            pass
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("neither TLS nor client authentication" in w for w in warnings) == warned
