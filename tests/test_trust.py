"""What an operator is told about exposing the server, and the settings table."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from mmcache.server import EventsConfig, L2Config, MMCacheServer, ServerConfig, ShmConfig, TlsConfig
from mmcache.server._config import SETTINGS, ConfigError, parse_serve_args, setting_paths

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
        settings["tls"] = TlsConfig(str(certs / "server.crt"), str(certs / "server.key"))
    with caplog.at_level(logging.WARNING, logger="mmcache.server._app"):
        async with MMCacheServer(server_config(**settings)):
            pass
    logged = warnings_of(caplog)
    assert (warned in logged) if warned else logged == ""


def test_every_setting_has_a_flag_or_variable_and_a_field() -> None:
    assert sorted(s.field for s in SETTINGS) == sorted(setting_paths())
    assert "l2.timeout_s" in setting_paths() and "port" in setting_paths()
    assert all(s.env.startswith("MMCACHE_") for s in SETTINGS)
    assert len({s.env for s in SETTINGS}) == len(SETTINGS)


def test_a_flag_beats_its_variable_which_beats_the_default() -> None:
    env = {"MMCACHE_LEASE_S": "5", "MMCACHE_CAPACITY_GB": "0.5", "MMCACHE_REFLECTION": "off"}
    config = parse_serve_args(["--lease-s", "7"], env)
    assert (config.lease_s, config.capacity_bytes, config.reflection) == (7, 1 << 29, False)
    assert parse_serve_args([], {}) == ServerConfig()


def test_a_bad_variable_is_named_and_a_token_is_never_echoed() -> None:
    with pytest.raises(ConfigError, match="MMCACHE_MAX_NAMESPACES='0' is invalid: must be"):
        parse_serve_args([], {"MMCACHE_MAX_NAMESPACES": "0"})
    with pytest.raises(ConfigError, match="MMCACHE_TOKENS=<hidden>") as hidden:
        parse_serve_args([], {"MMCACHE_TOKENS": "   "})
    assert "   " not in str(hidden.value).split("=", 1)[1].split(" is invalid")[0]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"port": 5000, "metrics_port": 5000}, "give each its own"),
        ({"port": 5000, "health_port": 5000}, "--health-port 5000 is also --port"),
        ({"max_items": 0}, "max_items must be >= 1"),
        ({"lease_s": 0}, "lease_s must be more than 0"),
    ],
)
def test_the_config_checks_itself(settings: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ServerConfig(**settings)  # type: ignore[arg-type]


L2_URL = "redis://127.0.0.1:7000"


@pytest.mark.parametrize(
    ("part", "message"),
    [
        (lambda: L2Config(L2_URL, admit="third"), "--l2-admit must be first or second"),
        (lambda: L2Config(L2_URL, timeout_s=0), "--l2-timeout-ms must be more than 0"),
        (lambda: L2Config(L2_URL, wait_s=-1), "--l2-wait-ms must be more than 0"),
        (lambda: L2Config(L2_URL, window_s=0), "--l2-window-s must be more than 0"),
        (lambda: L2Config(L2_URL, ttl_s=-1), "--l2-ttl-s must be >= 0"),
        (lambda: L2Config(L2_URL, queue_items=0), "--l2-queue-items >= 1"),
        (lambda: L2Config(L2_URL, prefix="fleet{a}:"), "--l2-prefix 'fleet{a}:' holds a brace"),
        (lambda: L2Config("redis://nohost"), "--l2 'redis://nohost'"),
        (lambda: ShmConfig(bytes=1000), "region must be 1 MiB or more: 1000"),
    ],
)
def test_each_part_checks_itself_naming_its_flag(part: Callable[[], object], message: str) -> None:
    # Built in code as from flags: the same rules, the message naming the flag to change.
    with pytest.raises(ConfigError, match=re.escape(message)):
        part()


def test_a_bad_l2_url_is_refused_with_the_fix_and_never_echoes_its_password() -> None:
    with pytest.raises(ConfigError, match="host:port"):
        L2Config("redis://nohost")
    with pytest.raises(ConfigError, match="redis://") as caught:
        L2Config("http://user:secret@h:1")
    assert "secret" not in str(caught.value)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tls-key", "k.pem"], "--tls-cert and --tls-key go together"),
        (["--tls-cert", "c.pem"], "--tls-cert and --tls-key go together"),
        (["--tls-client-ca", "ca.pem"], "needs TLS"),
        (["--events-replay-endpoint", "tcp://*:5558"], "give both"),
    ],
)
def test_settings_that_go_together_are_refused_alone(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_serve_args(argv, {})


def test_flags_build_each_part_with_the_defaults_of_its_value_object() -> None:
    config = parse_serve_args(
        ["--l2", L2_URL, "--l2-wait-ms", "250", "--no-shm", "--tls-cert", "c", "--tls-key", "k"],
        {"MMCACHE_EVENTS_ENDPOINT": "tcp://*:5557", "MMCACHE_SHM_MB": "64"},
    )
    assert config.l2 == L2Config(L2_URL, wait_s=0.25)
    assert config.shm == ShmConfig(enabled=False, bytes=64 << 20)
    assert config.tls == TlsConfig("c", "k") and not config.verifies_clients
    assert config.events == EventsConfig("tcp://*:5557")
    # A part's options without the setting that turns it on change nothing, as before.
    alone = parse_serve_args(["--l2-admit", "first", "--events-topic", "t"], {})
    assert alone.l2 is None and alone.events is None
    # A prefix L2 would refuse is a bad value whether L2 is on or not.
    refused = "MMCACHE_L2_PREFIX='a{b}' is invalid: holds a brace"
    with pytest.raises(ConfigError, match=re.escape(refused)):
        parse_serve_args([], {"MMCACHE_L2_PREFIX": "a{b}"})


def test_help_shows_the_value_objects_defaults() -> None:
    shown = {s.field: s.default_text() for s in SETTINGS}
    assert shown["l2.timeout_s"] == f"{L2Config.timeout_s * 1000:g}" == "1000"
    assert shown["shm.bytes"] == f"{ShmConfig.bytes >> 20}" and shown["shm.enabled"] == "on"
    assert shown["events.topic"] == EventsConfig.topic
    assert shown["l2.url"] == shown["tls.cert"] == shown["events.endpoint"] == "none"


def test_readme_tables_every_setting_with_its_default() -> None:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    rows = {}
    for line in readme.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) == 4 and cells[1].startswith("`MMCACHE_"):
            rows[cells[1].strip("`")] = cells
    for setting in SETTINGS:
        assert setting.env in rows, setting.env
        flag, _, default, meaning = rows[setting.env]
        if setting.flag is not None:
            assert setting.flag.removeprefix("--") in flag, setting.flag
        shown = setting.default_text()
        assert default == (shown if shown == "none" else f"`{shown}`"), setting.env
        assert meaning == setting.help, setting.env
