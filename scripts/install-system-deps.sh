#!/usr/bin/env bash
# Installs the external programs the deploy checks (tests/deploy, scripts/check_deploy.sh)
# need, from Debian packages only, and only those that are missing:
#
#   program                        Debian package (bookworm)        why
#   kubectl (with `kustomize`)     kubernetes-client 1.20.x         renders deploy/k8s
#   docker-compose                 docker-compose 1.29.2            `docker-compose config`
#   prometheus, promtool           prometheus 2.42.0                real-Prometheus tests
#   redis-server, redis-cli        redis-server 7.0.15              the L2 tier's Redis Cluster
#   podman, mmdebstrap             podman 4.3, mmdebstrap 1.3       the image, built and run
#   podman-compose (+ dnsname)     podman-compose 1.0.3             the local stack on podman
#                                  (and CNI's dnsname plugin: services find each other by name)
#   curl                           curl 7.88                        the quick starts' requests
#
# A kubectl that is already on PATH (e.g. the Google Cloud SDK's `kubectl` package,
# v1.32 with kustomize v5) is kept: the manifests render with either. The offline
# Kubernetes schema validator is a Python package (kubernetes-validate, in the
# `test` extra), not installed here.
#
# Idempotent and fast when everything is present (no apt-get at all then); runs
# `apt-get update` once, only when something has to be installed. Non-interactive;
# needs root (or sudo) only when it installs.
set -euo pipefail

declare -A package_for=(
    [kubectl]=kubernetes-client
    [docker-compose]=docker-compose
    [prometheus]=prometheus
    [promtool]=prometheus
    [redis-server]=redis-server
    [redis-cli]=redis-server
    # With what the image checks use of its recommends (rootful, host network).
    [podman]="podman uidmap slirp4netns fuse-overlayfs"
    [mmdebstrap]=mmdebstrap
    [podman-compose]="podman-compose golang-github-containernetworking-plugin-dnsname"
    [curl]=curl
)

have() {
    case "$1" in
        # `kubectl kustomize` exists since kubectl 1.14; check the subcommand, not just the binary.
        kubectl) command -v kubectl >/dev/null 2>&1 && kubectl kustomize --help >/dev/null 2>&1 ;;
        # Podman's CNI backend resolves service names only with the dnsname plugin.
        podman-compose) command -v podman-compose >/dev/null 2>&1 && [ -x /usr/lib/cni/dnsname ] ;;
        *) command -v "$1" >/dev/null 2>&1 ;;
    esac
}

missing=()
for program in kubectl docker-compose prometheus promtool redis-server redis-cli podman mmdebstrap podman-compose curl; do
    if ! have "$program"; then
        package=${package_for[$program]}
        if [[ " ${missing[*]-} " != *" $package "* ]]; then
            # shellcheck disable=SC2206 # a value may name several packages
            missing+=($package)
        fi
    fi
done

if ((${#missing[@]} == 0)); then
    echo "install-system-deps: kubectl, docker-compose, prometheus, promtool, redis, podman, mmdebstrap, podman-compose, curl all present"
    exit 0
fi

if [[ $(id -u) -eq 0 ]]; then
    sudo=()
elif command -v sudo >/dev/null 2>&1; then
    sudo=(sudo)
else
    echo "install-system-deps: need root (or sudo) to install: ${missing[*]}" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-system-deps: no apt-get; install these Debian packages or equivalents: ${missing[*]}" >&2
    exit 1
fi

echo "install-system-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
# --no-install-recommends: prometheus would otherwise pull node-exporter and friends.
# Services are not started in containers (policy-rc.d) and nothing here needs them running:
# the tests start their own prometheus and Redis Cluster on free loopback ports.
"${sudo[@]}" apt-get install -y -qq --no-install-recommends \
    -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold \
    "${missing[@]}"

for program in kubectl docker-compose prometheus promtool redis-server redis-cli podman mmdebstrap podman-compose curl; do
    if ! have "$program"; then
        echo "install-system-deps: $program still missing after installing ${missing[*]}" >&2
        exit 1
    fi
done
echo "install-system-deps: done"
