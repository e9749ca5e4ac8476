"""The vLLM plugin's former import path, kept for existing installs and scripts.

`mmcache.client.vllm_plugin:register` was the `vllm.general_plugins` entry
point; the plugin is now the package `mmcache.client.vllm` (docs/vllm.md).
This module re-exports its former names, with their former arguments
(`connection_settings` now gives MMCacheClient's `tls=`, not its tls_* ones).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from .vllm import Settings, ec_scope_of, register, scope_of
from .vllm import client_for as process_client

if TYPE_CHECKING:
    from .vllm.runtime import SyncClient

__all__ = ["client_for", "connection_settings", "ec_scope_of", "register", "scope_of"]


def client_for(target: str, deadline_s: float) -> SyncClient:
    """This process's SyncClient of `target` (one per process and target)."""
    return process_client(replace(Settings.from_env(), target=target, deadline_s=deadline_s))


def connection_settings(env: Mapping[str, str]) -> dict[str, Any]:
    """MMCacheClient's namespace, token and TLS arguments, from `env`."""
    return Settings.from_env(env).client_options()
