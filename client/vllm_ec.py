"""The EC connector's former module path, kept for existing configurations:
`"ec_connector_module_path": "mmcache.client.vllm_ec"` still loads
`MMCacheECConnector`, now `mmcache.client.vllm.connector` (docs/vllm.md).
"""

from .vllm.connector import MMCacheECConnector, MMCacheECMetadata, MMCacheECStats

__all__ = ["MMCacheECConnector", "MMCacheECMetadata", "MMCacheECStats"]
