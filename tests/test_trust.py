"""What an operator is told about exposing the server, and the settings table."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from mmcache.server import MMCacheServer, ServerConfig
from mmcache.server._config import SETTINGS, ConfigError, parse_serve_args

from .conftest import server_config

TOKENS = "write " + "k" * 32


def warnings_of(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


@pytest.mark.parametrize(
    ("host", "secure", "warned"),
    [
        ("0.0.0.0", "none", "with neither TLS nor tokens"),
        ("0.0.0.0", "tokens", "tokens and items cross the network unencrypted"),
        ("0.0.0.0", "tls", "neither tokens nor client certificates"),
        ("0.0.0.0", "tls+tokens", ""),
        ("127.0.0.1", "none", ""),
    ],
)
async def test_a_bind_beyond_loopback_is_warned_of_what_it_exposes(
    caplog: pytest.LogCaptureFixture, certs: Path, host: str, secure: str, warned: str
) -> None:
    settings: dict[str, object] = {"host": host}
    if "tokens" in secure:
        settings["tokens"] = TOKENS
    if "tls" in secure:
        settings.update(tls_cert=str(certs / "server.crt"), tls_key=str(certs / "server.key"))
    with caplog.at_level(logging.WARNING, logger="mmcache.server._app"):
        async with MMCacheServer(server_config(**settings)):
            pass
    logged = warnings_of(caplog)
    assert (warned in logged) if warned else logged == ""


def test_every_setting_has_a_flag_or_variable_and_a_field() -> None:
    fields = set(ServerConfig.__dataclass_fields__)
    assert {s.field for s in SETTINGS} == fields
    assert all(s.env.startswith("MMCACHE_") for s in SETTINGS)
    assert len({s.env for s in SETTINGS}) == len(SETTINGS)


def test_a_flag_beats_its_variable_which_beats_the_default() -> None:
    env = {"MMCACHE_LEASE_S": "5", "MMCACHE_CAPACITY_GB": "0.5", "MMCACHE_REFLECTION": "off"}
    config = parse_serve_args(["--lease-s", "7"], env)
    assert (config.lease_s, config.capacity_bytes, config.reflection) == (7, 1 << 29, False)
    assert parse_serve_args([], {}).lease_s == ServerConfig().lease_s


def test_a_bad_variable_is_named_and_a_token_is_never_echoed() -> None:
    with pytest.raises(ConfigError, match="MMCACHE_MAX_NAMESPACES='0' is invalid: must be"):
        parse_serve_args([], {"MMCACHE_MAX_NAMESPACES": "0"})
    with pytest.raises(ConfigError, match="MMCACHE_TOKENS=<hidden>") as hidden:
        parse_serve_args([], {"MMCACHE_TOKENS": "   "})
    assert "   " not in str(hidden.value).split("=", 1)[1].split(" is invalid")[0]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"tls_key": "k.pem"}, "--tls-cert and --tls-key go together"),
        ({"tls_client_ca": "ca.pem"}, "needs TLS"),
        ({"port": 5000, "metrics_port": 5000}, "give each its own"),
        ({"port": 5000, "health_port": 5000}, "--health-port 5000 is also --port"),
    ],
)
def test_the_config_checks_itself(settings: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ServerConfig(**settings)  # type: ignore[arg-type]


def test_readme_tables_every_setting() -> None:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    for setting in SETTINGS:
        assert f"`{setting.env}`" in readme, setting.env
        if setting.flag is not None:
            assert setting.flag.removeprefix("--") in readme, setting.flag
