#!/usr/bin/env bash
# Regenerate the Python code of proto/ (committed beside the .proto files).
# `scripts/gen_proto.sh --check` fails when the committed code is stale.
set -euo pipefail
cd "$(dirname "$0")/.."
out=proto
if [ "${1:-}" = "--check" ]; then
  out=$(mktemp -d)
  trap 'rm -rf "$out"' EXIT
fi
# protoc's mypy plugin reports each file it writes: show the output on failure only.
if ! log=$(python -m grpc_tools.protoc -Iproto --python_out="$out" --mypy_out="$out" \
    proto/mmcache/v1/*.proto 2>&1); then
  echo "$log" >&2
  exit 1
fi
if [ "${1:-}" = "--check" ]; then
  for f in "$out"/mmcache/v1/*; do
    name=$(basename "$f")
    if ! cmp -s "$f" "proto/mmcache/v1/$name"; then
      echo "proto/mmcache/v1/$name is stale: run scripts/gen_proto.sh and commit" >&2
      exit 1
    fi
  done
  echo "generated protobuf code is current"
fi
