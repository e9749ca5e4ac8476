"""NVIDIA Dynamo's multimodal transport, by its public path.

The transport lives in the vLLM package (mmcache.client.vllm.dynamo), whose
plugin installs it in Dynamo's vLLM processes; this path stays for those
who name it.
"""

from __future__ import annotations

from .vllm.dynamo import EXTRA_KEY, TESTED_DYNAMO, install

__all__ = ["EXTRA_KEY", "TESTED_DYNAMO", "install"]
