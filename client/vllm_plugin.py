"""The vLLM plugin's former import path, kept for existing installs and scripts.

`mmcache.client.vllm_plugin:register` was the `vllm.general_plugins` entry
point; the plugin is now the package `mmcache.client.vllm` (docs/vllm.md).
"""

from .vllm import client_for, connection_settings, ec_scope_of, register, scope_of

__all__ = ["client_for", "connection_settings", "ec_scope_of", "register", "scope_of"]
