#!/usr/bin/env bash
# A local Redis Cluster, to try the L2 tier on one machine: three masters on
# loopback, no persistence, each bounded with allkeys-lru as docs/l2.md asks.
#
#   scripts/redis-cluster.sh up [PORT...]     start them (7000 7001 7002 by default)
#                                             and form the cluster; prints the --l2 URL
#   scripts/redis-cluster.sh down [PORT...]   stop them and remove their files
#
# Needs redis-server and redis-cli (apt-get install redis-server). Files live in
# ${REDIS_CLUSTER_DIR:-/tmp/mmcache-redis-cluster}/PORT; each port + 10000 is
# its cluster bus, so it must be free too. REDIS_MAXMEMORY (default 1gb) bounds
# each master.
set -euo pipefail
command=${1:-}
shift || true
ports=("$@")
[[ ${#ports[@]} -gt 0 ]] || ports=(7000 7001 7002)
dir=${REDIS_CLUSTER_DIR:-/tmp/mmcache-redis-cluster}

die() {
    echo "redis-cluster: $*" >&2
    exit 1
}

up() {
    command -v redis-server >/dev/null && command -v redis-cli >/dev/null \
        || die "redis-server and redis-cli are missing (apt-get install redis-server)"
    [[ ${#ports[@]} -ge 3 ]] || die "a Redis Cluster needs three masters at least; got ${ports[*]}"
    local nodes=()
    for port in "${ports[@]}"; do
        mkdir -p "$dir/$port"
        redis-server --port "$port" --bind 127.0.0.1 --daemonize yes \
            --cluster-enabled yes --cluster-config-file "$dir/$port/nodes.conf" \
            --cluster-require-full-coverage no --save "" --appendonly no \
            --maxmemory "${REDIS_MAXMEMORY:-1gb}" --maxmemory-policy allkeys-lru \
            --dir "$dir/$port" --logfile "$dir/$port/redis.log" \
            --pidfile "$dir/$port/redis.pid" \
            || die "redis-server on port $port did not start (is the port, or port + 10000, taken?)"
        nodes+=("127.0.0.1:$port")
    done
    for port in "${ports[@]}"; do
        for _ in $(seq 100); do
            [[ $(redis-cli -p "$port" PING 2>/dev/null) == PONG ]] && break
            sleep 0.05
        done
    done
    redis-cli --cluster create "${nodes[@]}" --cluster-replicas 0 --cluster-yes >/dev/null \
        || die "the cluster did not form (logs: $dir/PORT/redis.log)"
    for _ in $(seq 200); do
        if redis-cli -p "${ports[0]}" CLUSTER INFO | grep -q cluster_state:ok; then
            echo "redis-cluster: up; give the sidecars --l2 redis://127.0.0.1:${ports[0]}"
            return
        fi
        sleep 0.05
    done
    die "the cluster did not reach cluster_state:ok"
}

down() {
    for port in "${ports[@]}"; do
        redis-cli -p "$port" SHUTDOWN NOSAVE >/dev/null 2>&1 || true
        rm -rf "${dir:?}/$port"
    done
    echo "redis-cluster: down"
}

case $command in
    up) up ;;
    down) down ;;
    *) die "usage: scripts/redis-cluster.sh up|down [PORT...]" ;;
esac
