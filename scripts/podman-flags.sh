# Sourced by scripts/image-build.sh (and read by tests/deploy/test_image.py):
# what podman needs on our CI machines, which are VMs with a hybrid cgroup
# layout and tight resource limits.
#
# - crun sets a container's RLIMIT_NOFILE and RLIMIT_NPROC, by default above
#   the limits a process here may raise to: give limits within ours.
# - crun refuses a hybrid cgroup layout in which cgroup v2 holds controllers
#   ("cgroups in hybrid mode not supported"): here only hugetlb sits there,
#   unused; mounting it as a v1 hierarchy moves it (root only).
# - host networking: the build and the container reach what the host reaches.
# shellcheck shell=bash

PODMAN_FLAGS=(--network host --ulimit nofile=1024:1024 --ulimit nproc=4096:4096)
PODMAN_WHY=""

_move_v2_controllers_to_v1() {
    local unified=/sys/fs/cgroup/unified controller
    [ -r "$unified/cgroup.controllers" ] || return 1
    [ "$(id -u)" -eq 0 ] || return 1
    for controller in $(cat "$unified/cgroup.controllers"); do
        mkdir -p "/sys/fs/cgroup/$controller"
        mount -t cgroup -o "$controller" cgroup "/sys/fs/cgroup/$controller" || return 1
    done
}

# podman_can_run IMAGE: whether a container of IMAGE runs here (fixing what
# can be fixed); PODMAN_WHY says why not.
podman_can_run() {
    local image=$1 out
    if ! command -v podman >/dev/null 2>&1; then
        PODMAN_WHY="podman is not installed (scripts/install-system-deps.sh installs it)"
        return 1
    fi
    if out=$(podman run --rm "${PODMAN_FLAGS[@]}" --entrypoint true "$image" 2>&1); then
        return 0
    fi
    if [[ $out == *"hybrid mode"* ]] && _move_v2_controllers_to_v1 \
        && out=$(podman run --rm "${PODMAN_FLAGS[@]}" --entrypoint true "$image" 2>&1); then
        return 0
    fi
    PODMAN_WHY=$out
    return 1
}
