#!/usr/bin/env bash
# Build the sidecar image (deploy/docker/Dockerfile) with podman, as CI does,
# where no Docker engine runs and no container registry is reachable:
#
#   1. a minimal Debian rootfs with python3, python3-venv and tini, made by
#      mmdebstrap from Debian's mirror, imported as the base image
#      (ARG PYTHON_IMAGE); made once, then reused;
#   2. a wheelhouse of the server's dependencies at the tested pins
#      (constraints.txt), downloaded on the host, mounted into the build
#      (PIP_NO_INDEX=1: the build reaches no index);
#   3. podman build --format docker.
#
# Prints the image's name and size. Exit 77: podman cannot run containers on
# this machine (the tests then skip, saying why). Needs root, podman and
# mmdebstrap (scripts/install-system-deps.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
image=${MMCACHE_IMAGE:-localhost/mmcache:ci}
base=${MMCACHE_BASE_IMAGE:-localhost/mmcache-base:bookworm}
work=${MMCACHE_IMAGE_WORK:-/var/tmp/mmcache-image}
mkdir -p "$work"
# shellcheck source=scripts/podman-flags.sh
. scripts/podman-flags.sh

if ! command -v podman >/dev/null 2>&1 || ! command -v mmdebstrap >/dev/null 2>&1; then
    echo "image-build: podman cannot run containers here: podman or mmdebstrap is missing" \
        "(scripts/install-system-deps.sh installs both)" >&2
    exit 77
fi

if ! podman image exists "$base"; then
    echo "image-build: making the base image $base with mmdebstrap"
    mmdebstrap --quiet --variant=minbase \
        --include=python3,python3-venv,tini,ca-certificates \
        bookworm "$work/rootfs.tar"
    podman import --quiet "$work/rootfs.tar" "$base" >/dev/null
    rm -f "$work/rootfs.tar"
fi
if ! podman_can_run "$base"; then
    echo "image-build: podman cannot run containers here: $PODMAN_WHY" >&2
    exit 77
fi

wheels="$work/wheels"
rm -rf "$wheels"
mkdir -p "$wheels"
# The base's python3 is Debian bookworm's 3.11, as ours: the same wheels fit
# (plus what redis-py needs below 3.11.3: bookworm has 3.11.2).
python=${PYTHON:-python3}
"$python" -m pip download --quiet --disable-pip-version-check -c constraints.txt \
    -d "$wheels" . "setuptools>=69" wheel "async-timeout>=4.0.3"

podman build --quiet --format docker "${PODMAN_FLAGS[@]}" \
    --volume "$wheels:/wheelhouse:ro" \
    --build-arg "PYTHON_IMAGE=$base" \
    --build-arg PIP_NO_INDEX=1 --build-arg PIP_FIND_LINKS=/wheelhouse \
    -f deploy/docker/Dockerfile -t "$image" . >/dev/null
size=$(podman image inspect --format '{{.Size}}' "$image")
echo "image-build: $image, $((size / 1024 / 1024)) MiB"
