"""The EC connector by name: vLLM 0.32 on lets a plugin register a connector
with its factory, so a configuration names it alone,
`{"ec_connector": "MMCacheECConnector", "ec_role": "ec_both", ...}`, with no
`ec_connector_module_path` (still accepted). Registered by the plugin in
every process vLLM loads it in (the engine's, its workers'), whether or not
MMCACHE_TARGET is set: the connector has settings of its own.
"""

from __future__ import annotations

import contextlib

__all__ = ["CONNECTOR_CLASS", "register_ec_connector"]

CONNECTOR_CLASS = "MMCacheECConnector"
_MODULE = "mmcache.client.vllm.connector"


def register_ec_connector() -> bool:
    """Register the connector's name (lazily: nothing is imported until vLLM
    makes one). Idempotent; False where vLLM has no EC connectors."""
    try:
        from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
    except ImportError:  # a vLLM before EC connectors
        return False
    # Registered already: the plugin loads once per process, or more.
    with contextlib.suppress(ValueError):
        ECConnectorFactory.register_connector(CONNECTOR_CLASS, _MODULE, CONNECTOR_CLASS)
    return True
