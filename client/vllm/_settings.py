"""mmcache's settings in vLLM's processes, read in one place.

The plugin reads them from the environment (`MMCACHE_*`: vLLM 0.32 takes no
new cache-type name, hence variables); the EC connector from its
`ec_connector_extra_config`, falling back to the same variables. Both are
frozen values, read when a cache or a connector is made (docs/vllm.md lists
each setting).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mmcache.client import Tls

__all__ = ["UNTESTED_ENV", "ECSettings", "Settings"]

_OFF = ("0", "off", "false", "no")
# Run on a vLLM release the plugin was not tested with (_releases.py).
UNTESTED_ENV = "MMCACHE_VLLM_UNTESTED"


@dataclass(frozen=True)
class Settings:
    """The sidecar and how to reach it: the plugin's settings, and the
    connection settings of the EC connector."""

    target: str = ""  # MMCACHE_TARGET, host:port; empty: the plugin is inert
    deadline_s: float = 1.0  # MMCACHE_DEADLINE_S: the longest a cache call may take
    namespace: str = ""  # MMCACHE_NAMESPACE: the server namespace, also in every key scope
    token: str | None = None  # MMCACHE_TOKEN
    token_file: str | None = None  # MMCACHE_TOKEN_FILE (a mounted Secret), read on use
    tls_ca: str | None = None  # MMCACHE_TLS_CA
    tls_cert: str | None = None  # MMCACHE_TLS_CERT (mTLS)
    tls_key: str | None = None  # MMCACHE_TLS_KEY (mTLS)
    tls_server_name: str | None = None  # MMCACHE_TLS_SERVER_NAME
    shm: bool = True  # MMCACHE_SHM: 0 keeps items off the sidecar's shared memory
    untested: bool = False  # MMCACHE_VLLM_UNTESTED=1: run on an untested vLLM release
    # MMCACHE_VLLM_METRICS_PORT: the plugin's counters served from this process
    # (one with no /metrics of its own: Dynamo's frontend); 0: off
    metrics_port: int = 0
    # MMCACHE_SINGLE_FLIGHT: a new image is processed by one API process while
    # the others wait for its upload (docs/vllm.md); on/off, unset: on where
    # vLLM runs several API servers
    single_flight: bool | None = None
    # MMCACHE_SHARE_SMALL: on shares small images by the common rules; auto
    # (None, the default) keeps them in their API process, as vLLM alone does,
    # and where several API processes share the sidecar shares them through
    # its shared memory alone; off keeps them in their process, not
    # uploaded, with several API servers too (client/vllm/_small.py)
    share_small: bool | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """The settings `env` (default: this process's environment) gives."""
        env = os.environ if env is None else env
        return cls(
            target=env.get("MMCACHE_TARGET", ""),
            deadline_s=_seconds("MMCACHE_DEADLINE_S", env.get("MMCACHE_DEADLINE_S", 1.0)),
            namespace=env.get("MMCACHE_NAMESPACE", ""),
            token=env.get("MMCACHE_TOKEN") or None,
            token_file=env.get("MMCACHE_TOKEN_FILE") or None,
            tls_ca=env.get("MMCACHE_TLS_CA") or None,
            tls_cert=env.get("MMCACHE_TLS_CERT") or None,
            tls_key=env.get("MMCACHE_TLS_KEY") or None,
            tls_server_name=env.get("MMCACHE_TLS_SERVER_NAME") or None,
            shm=env.get("MMCACHE_SHM", "on").strip().lower() not in _OFF,
            untested=env.get(UNTESTED_ENV, "") == "1",
            metrics_port=_port("MMCACHE_VLLM_METRICS_PORT", env.get("MMCACHE_VLLM_METRICS_PORT")),
            single_flight=_switch("MMCACHE_SINGLE_FLIGHT", env.get("MMCACHE_SINGLE_FLIGHT")),
            share_small=_switch("MMCACHE_SHARE_SMALL", env.get("MMCACHE_SHARE_SMALL")),
        )

    def client_options(self) -> dict[str, Any]:
        """MMCacheClient's namespace, token, TLS and shared-memory arguments
        (the token file, when one is named and no token is, read now)."""
        token = self.token
        if token is None and self.token_file:
            with open(self.token_file, encoding="utf-8") as file:
                token = file.read().strip()
        return {
            "namespace": self.namespace,
            "token": token,
            "tls": self.tls(),
            "shm": self.shm,
        }

    def tls(self) -> Tls | None:
        """The client's TLS settings; None (plaintext) unless a CA, certificate
        or key is named (a server name alone only renames a TLS server)."""
        if not (self.tls_ca or self.tls_cert or self.tls_key):
            return None
        # Here, not at the top: the plugin's entry point reads settings in
        # every vLLM process, and needs the client only where a target is set.
        from mmcache.client import Tls

        return Tls(self.tls_ca, self.tls_cert, self.tls_key, self.tls_server_name)


@dataclass(frozen=True)
class ECSettings:
    """The EC connector's settings: `ec_connector_extra_config` over the
    environment's."""

    sidecar: Settings  # its target and deadline_s those of the extra config, where given
    staging_bytes: int = 1 << 30  # staging_gb: the bytes staged at once
    staging_dir: str | None = None  # where staged outputs are written (None: /dev/shm)
    lookup: str = "mirror"  # or "sidecar": also ask the sidecar for items its mirror lacks

    @classmethod
    def from_extra(
        cls, extra: Mapping[str, Any], env: Mapping[str, str] | None = None
    ) -> ECSettings:
        base = Settings.from_env(env)
        target = extra.get("target") or base.target
        if not target:
            raise ValueError(
                "MMCacheECConnector needs the sidecar: set ec_connector_extra_config "
                '{"target": "host:port"} or MMCACHE_TARGET'
            )
        lookup = str(extra.get("lookup", "mirror"))
        if lookup not in ("mirror", "sidecar"):
            raise ValueError(f'lookup is "mirror" or "sidecar", not {lookup!r}')
        deadline_s = _seconds("deadline_s", extra.get("deadline_s", base.deadline_s))
        return cls(
            sidecar=replace(base, target=str(target), deadline_s=deadline_s),
            staging_bytes=int(float(extra.get("staging_gb", 1.0)) * (1 << 30)),
            staging_dir=extra.get("staging_dir"),
            lookup=lookup,
        )


def _seconds(name: str, value: Any) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} is a number of seconds, not {value!r}") from None
    if not seconds > 0:  # a call that may take no time fails open every time
        raise ValueError(f"{name} is a number of seconds more than 0, not {value!r}")
    return seconds


def _switch(name: str, value: str | None) -> bool | None:
    """on/off, or None where unset ("auto")."""
    said = (value or "").strip().lower()
    if said in ("", "auto"):
        return None
    if said in _OFF:
        return False
    if said in ("1", "on", "true", "yes"):
        return True
    raise ValueError(f"{name}={value!r}: give on, off or auto (or leave it unset)")


def _port(name: str, value: str | None) -> int:
    """A port from the environment, 0 when unset; ValueError naming `name`."""
    if not value:
        return 0
    if not value.isdigit() or not 0 < int(value) < 65536:
        raise ValueError(f"{name} must be a port number (1-65535), e.g. 9480; got {value!r}")
    return int(value)
