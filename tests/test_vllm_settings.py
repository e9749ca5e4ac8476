"""The vLLM integration's one settings reader (client/vllm/_settings.py) and
its key scope (client/vllm/_keys.py): no vLLM needed."""

from __future__ import annotations

from pathlib import Path

import pytest

from mmcache.client import Tls
from mmcache.client.vllm import ECSettings, Settings, scoped_key


def test_the_environment_gives_the_plugins_settings(tmp_path: Path) -> None:
    assert Settings.from_env({}) == Settings()  # inert: no target
    (tmp_path / "token").write_text("s3cret\n")
    settings = Settings.from_env(
        {
            "MMCACHE_TARGET": "sidecar:50051",
            "MMCACHE_DEADLINE_S": "0.25",
            "MMCACHE_NAMESPACE": "tiny@1",
            "MMCACHE_TOKEN_FILE": str(tmp_path / "token"),
            "MMCACHE_TLS_CA": "",  # empty is unset
            "MMCACHE_SHM": "off",
            "MMCACHE_VLLM_UNTESTED": "1",
        }
    )
    assert (settings.target, settings.deadline_s, settings.untested) == (
        "sidecar:50051",
        0.25,
        True,
    )
    assert settings.client_options() == {
        "namespace": "tiny@1",
        "token": "s3cret",  # read from the file
        "tls": None,  # no MMCACHE_TLS_*: plaintext
        "shm": False,
    }
    tls = Settings.from_env({"MMCACHE_TLS_CA": "ca.crt", "MMCACHE_TLS_SERVER_NAME": "sidecar"})
    assert tls.client_options()["tls"] == Tls(ca="ca.crt", server_name="sidecar")
    named = Settings.from_env({"MMCACHE_TLS_SERVER_NAME": "sidecar"})  # no CA: plaintext
    assert named.client_options()["tls"] is None
    with pytest.raises(ValueError, match="MMCACHE_DEADLINE_S is a number of seconds"):
        Settings.from_env({"MMCACHE_DEADLINE_S": "soon"})
    with pytest.raises(ValueError, match="MMCACHE_DEADLINE_S is a number of seconds more than 0"):
        Settings.from_env({"MMCACHE_DEADLINE_S": "0"})
    # Single flight: unset or auto leaves it to the API-server count.
    assert Settings.from_env({}).single_flight is None
    assert Settings.from_env({"MMCACHE_SINGLE_FLIGHT": "auto"}).single_flight is None
    assert Settings.from_env({"MMCACHE_SINGLE_FLIGHT": "on"}).single_flight is True
    assert Settings.from_env({"MMCACHE_SINGLE_FLIGHT": "0"}).single_flight is False
    with pytest.raises(ValueError, match="MMCACHE_SINGLE_FLIGHT='sometimes': give on, off"):
        Settings.from_env({"MMCACHE_SINGLE_FLIGHT": "sometimes"})


def test_the_ec_connectors_extra_config_goes_over_the_environment() -> None:
    env = {"MMCACHE_TARGET": "env:1", "MMCACHE_DEADLINE_S": "2", "MMCACHE_NAMESPACE": "ns"}
    ec = ECSettings.from_extra({}, env)
    assert (ec.sidecar.target, ec.sidecar.deadline_s, ec.lookup) == ("env:1", 2.0, "mirror")
    ec = ECSettings.from_extra(
        {"target": "extra:2", "deadline_s": 0.5, "staging_gb": 0.5, "lookup": "sidecar"}, env
    )
    assert (ec.sidecar.target, ec.sidecar.deadline_s) == ("extra:2", 0.5)
    assert (ec.staging_bytes, ec.lookup, ec.sidecar.namespace) == (1 << 29, "sidecar", "ns")
    with pytest.raises(ValueError, match="needs the sidecar"):
        ECSettings.from_extra({}, {})
    with pytest.raises(ValueError, match='lookup is "mirror" or "sidecar"'):
        ECSettings.from_extra({"lookup": "l2"}, env)


def test_a_key_is_the_identifier_in_its_scope() -> None:
    assert scoped_key("0123456789abcdef", "img-hash") == "0123456789abcdef:img-hash"


def test_small_images_are_shared_by_the_default_rule_unless_set_on_or_off() -> None:
    assert Settings.from_env({}).share_small is None  # auto: client/vllm/_small.py
    assert Settings.from_env({"MMCACHE_SHARE_SMALL": "auto"}).share_small is None
    assert Settings.from_env({"MMCACHE_SHARE_SMALL": "on"}).share_small is True
    assert Settings.from_env({"MMCACHE_SHARE_SMALL": "off"}).share_small is False
    with pytest.raises(ValueError, match="MMCACHE_SHARE_SMALL='big': give on, off"):
        Settings.from_env({"MMCACHE_SHARE_SMALL": "big"})
