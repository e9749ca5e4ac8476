#!/usr/bin/env bash
# The local stack of docker-compose.yml (mmcache, Prometheus, Grafana) where no
# Docker engine runs: podman 4.3 with podman-compose 1.0.3, as Debian bookworm
# has them (apt-get install podman podman-compose
# golang-github-containernetworking-plugin-dnsname).
#
#   scripts/podman-stack.sh up [SERVICE...]   start (all three services by default)
#   scripts/podman-stack.sh ps                what runs
#   scripts/podman-stack.sh down              stop; drop containers, network and volumes
#
# What it adds to `podman-compose up -d`, and why:
#   - the shared-memory volume is made here as a tmpfs: podman-compose 1.0.3
#     drops a volume's driver_opts (the volume would be a directory on disk),
#     and podman 4.3 refuses a tmpfs volume's `size=` (docker-compose on
#     podman's socket fails there). MMCACHE_SHM_MB bounds what the sidecar uses;
#   - containers get open-file and process limits within the caller's own:
#     crun's defaults can be above what a process may raise to (VMs with tight
#     limits), and as root on a hybrid cgroup layout the unused cgroup v2
#     controllers are moved (scripts/podman-flags.sh);
#   - with podman's CNI backend, services find each other by name only through
#     the dnsname plugin: its absence is an error here, not a Prometheus target
#     that stays down;
#   - the image mmcache:dev is built when missing, by scripts/image-build.sh
#     (a Debian base made with mmdebstrap: no container registry needed);
#   - `up` checks that every service it started runs: one whose image could not
#     be pulled (Grafana's, with no registry) is named with its image, exit 3.
#
# Environment: MMCACHE_IMAGE, PROMETHEUS_IMAGE, GRAFANA_IMAGE (the images);
# STACK_GRPC_PORT, STACK_METRICS_PORT, STACK_PROMETHEUS_PORT, STACK_GRAFANA_PORT
# (loopback ports on the host); STACK_PROJECT (names of containers and volumes,
# default mmcache); MMCACHE_CAPACITY_GB and the rest as docker-compose.yml reads.
set -euo pipefail
cd "$(dirname "$0")/.."
project=${STACK_PROJECT:-mmcache}
image=${MMCACHE_IMAGE:-mmcache:dev}
shm_volume="${project}_mmcache-shm"
# shellcheck source=scripts/podman-flags.sh
. scripts/podman-flags.sh

die() {
    echo "podman-stack: $*" >&2
    exit 1
}

# Open files: the caller's own hard limit. Processes: 4096, ample for each of
# the three services; crun cannot always set even the caller's own (gVisor).
limits() {
    local nofile
    nofile=$(ulimit -Hn)
    [[ $nofile == unlimited ]] && nofile=1048576
    printf -- '--ulimit nofile=%s:%s --ulimit nproc=4096:4096' "$nofile" "$nofile"
}

compose() {
    podman-compose -p "$project" --podman-run-args "$(limits)" "$@"
}

check_tools() {
    command -v podman >/dev/null 2>&1 || die "podman is not installed (apt-get install podman)"
    command -v podman-compose >/dev/null 2>&1 \
        || die "podman-compose is not installed (apt-get install podman-compose)"
    if [[ $(podman info --format '{{.Host.NetworkBackend}}') == cni ]] \
        && [[ ! -x /usr/lib/cni/dnsname ]]; then
        die "podman's CNI network has no dnsname plugin, so Prometheus could not find" \
            "the mmcache service by name (apt-get install golang-github-containernetworking-plugin-dnsname)"
    fi
}

up() {
    check_tools
    if ! podman image exists "$image"; then
        echo "podman-stack: no image $image: building it with scripts/image-build.sh (a few minutes)"
        MMCACHE_IMAGE=$image scripts/image-build.sh \
            || die "no image $image, and scripts/image-build.sh could not build it (above);" \
                "build it there, or name one with MMCACHE_IMAGE"
    fi
    podman_can_run "$image" || die "podman cannot run containers here: $PODMAN_WHY"
    if ! podman volume exists "$shm_volume"; then
        podman volume create --opt type=tmpfs --opt device=tmpfs --opt o=mode=1777 \
            "$shm_volume" >/dev/null
    fi
    export MMCACHE_IMAGE=$image
    # Logs of each podman command go to a file: a failure prints them.
    local log
    log=$(mktemp)
    if ! compose up -d --no-build "$@" >"$log" 2>&1; then
        cat "$log" >&2
        rm -f "$log"
        die "podman-compose up failed (above)"
    fi
    # podman-compose 1.0.3 exits 0 even when a container fails to start.
    # A service that cannot start (a port taken inside, a bad setting) exits at once.
    sleep 2
    local stopped
    stopped=$(podman ps -a --filter "label=io.podman.compose.project=$project" \
        --filter status=created --filter status=exited --format '{{.Names}}' | tr '\n' ' ')
    if [[ -n $stopped ]]; then
        grep -i error "$log" | grep -v -e 'no such volume' -e systemd >&2 || true
        rm -f "$log"
        die "not running: $stopped (podman logs NAME says more; scripts/podman-stack.sh down cleans up)"
    fi
    rm -f "$log"
    local wanted=("$@") missing=()
    [[ ${#wanted[@]} -gt 0 ]] || wanted=(mmcache prometheus grafana)
    for service in "${wanted[@]}"; do
        podman container exists "${project}_${service}_1" || missing+=("$service")
    done
    echo "podman-stack: up (project $project):"
    echo "  gRPC        127.0.0.1:${STACK_GRPC_PORT:-50051}"
    echo "  /metrics    http://127.0.0.1:${STACK_METRICS_PORT:-9470}/metrics"
    echo "  Prometheus  http://127.0.0.1:${STACK_PROMETHEUS_PORT:-9090}"
    if podman container exists "${project}_grafana_1"; then
        echo "  Grafana     http://127.0.0.1:${STACK_GRAFANA_PORT:-3000}"
    fi
    echo "  stop with: scripts/podman-stack.sh down"
    if [[ ${#missing[@]} -gt 0 ]]; then
        for service in "${missing[@]}"; do
            echo "podman-stack: $service did not start: its image ($(service_image "$service"))" \
                "could not be had (podman pull it, or name another with ${service^^}_IMAGE)" >&2
        done
        exit 3
    fi
}

service_image() {
    case $1 in
        mmcache) echo "$image" ;;
        prometheus) echo "${PROMETHEUS_IMAGE:-docker.io/prom/prometheus:v3.5.0}" ;;
        grafana) echo "${GRAFANA_IMAGE:-docker.io/grafana/grafana:12.2.0}" ;;
        *) echo "see docker-compose.yml" ;;
    esac
}

down() {
    command -v podman-compose >/dev/null 2>&1 || die "podman-compose is not installed"
    compose down -v >/dev/null 2>&1 || true
    # podman-compose 1.0.3's `down -v` leaves the project's volumes and network.
    local volumes
    volumes=$(podman volume ls -q --filter "label=io.podman.compose.project=$project")
    # shellcheck disable=SC2086 # one name per word
    [[ -z $volumes ]] || podman volume rm -f $volumes >/dev/null
    podman volume rm -f "$shm_volume" >/dev/null 2>&1 || true
    podman network rm -f "${project}_default" >/dev/null 2>&1 || true
    echo "podman-stack: down (project $project)"
}

case "${1:-}" in
    up) shift; up "$@" ;;
    down) down ;;
    ps) podman ps -a --filter "label=io.podman.compose.project=$project" ;;
    *) die "usage: scripts/podman-stack.sh up [SERVICE...] | ps | down" ;;
esac
