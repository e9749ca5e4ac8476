#!/usr/bin/env bash
# mypy --strict on the package. The folders map onto one namespace
# (core/ -> mmcache, server/ -> mmcache.server, ...), which mypy cannot follow,
# so it checks a tree of symbolic links laid out as the installed package.
set -euo pipefail
cd "$(dirname "$0")/.."
stage=build/typecheck
rm -rf "$stage"
mkdir -p "$stage/mmcache"
for f in core/*.py core/py.typed; do ln -s "../../../$f" "$stage/mmcache/$(basename "$f")"; done
for pkg in server client metrics; do ln -s "../../../$pkg" "$stage/mmcache/$pkg"; done
ln -s ../../../proto/mmcache/v1 "$stage/mmcache/v1"
cd "$stage"
# No incremental cache: the staged tree is new each run, and a stale cache
# once hid an error that a fresh checkout showed.
mypy --strict --no-incremental --config-file ../../pyproject.toml -p mmcache "$@"
