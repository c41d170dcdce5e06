#!/usr/bin/env bash
# A throwaway Redis from the OS package, for `make demo` and the test fixtures.
#
#   deploy/redis.sh install          apt-get install redis-server if it is missing
#   deploy/redis.sh start DATA_DIR   start a fresh redis-server (empty data) on a free 127.0.0.1 port
#   deploy/redis.sh start DATA_DIR --failover
#                                    a primary (DATA_DIR/primary), two replicas (DATA_DIR/replica-1..2) and
#                                    three Sentinels (DATA_DIR/sentinel-1..3, quorum 2, a primary is down
#                                    after 1 s) that promote a replica when the primary dies (the other then
#                                    replicates it); prints also `sentinels=HOST:PORT,...` and `master=rein`
#   deploy/redis.sh kill DATA_DIR    SIGKILL the server of DATA_DIR (DATA_DIR/primary: a failover) and leave it down
#   deploy/redis.sh stop DATA_DIR    stop the server started in DATA_DIR (TERM, bounded wait, then KILL)
#   deploy/redis.sh restart DATA_DIR [--kill]
#                                    stop it (--kill: SIGKILL, a crash) and start it again on the same
#                                    port with its data (the fault tests use this)
#
# Persistence: an append-only file fsynced on every write (appendfsync always), no RDB snapshots.
# The collectors' window and outbox live in Redis and records derived from them are already on
# Kafka, so a Redis that comes back must come back with every acknowledged write, even after a crash.
#
# After `start`, DATA_DIR holds: redis.pid, url (redis://127.0.0.1:PORT/0), port, version, redis.log,
# and the append-only files under appendonly/.
# `start` and `restart` print two lines: `url=redis://127.0.0.1:PORT/0` and `version=X.Y.Z`.
# Knobs (environment, optional): REDIS_START_TIMEOUT (seconds, default 20), REDIS_STOP_TIMEOUT (default 10),
# RESTART_DOWN_S (seconds `restart` leaves the server down, default 0).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=deploy/common.sh
source "$HERE/common.sh"
HOST=127.0.0.1

cmd_install() {
    if command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1; then
        log "$(redis-server --version | cut -d' ' -f1-3) already installed"
        return 0
    fi
    apt_install redis-cli redis-server redis-tools
}

need_redis() {
    command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1 ||
        die "redis-server/redis-cli not found on PATH: run deploy/redis.sh install (or apt-get install -y redis-server)"
}

# True when PID is a redis-server (guards against a recycled pid).
is_redis() { [[ -r "/proc/$1/comm" ]] && grep -q '^redis-server' "/proc/$1/comm"; }

# One attempt: 0 = up, 2 = the port was taken meanwhile (retry), else die.
# PORT (optional, may be empty) is the port to reuse on a restart; without it a free one is picked.
# Further arguments go to redis-server (a replica's --replicaof), or are a Sentinel's config (--sentinel).
start_once() {
    local dir="$1" port="${2:-}" deadline pid=""
    shift 2 || shift $#
    [[ -n "$port" ]] || port="$(free_ports 1)"
    rm -f "$dir/redis.pid" "$dir/redis.log"
    local server=(redis-server --bind "$HOST" --port "$port" --save '' --dir "$dir"
        --appendonly yes --appendfsync always --appenddirname appendonly
        --daemonize yes --pidfile "$dir/redis.pid" --logfile "$dir/redis.log"
        --databases 64 --protected-mode yes "$@")
    if [[ "${1:-}" == --sentinel ]]; then
        # A Sentinel rewrites its own config file: it gets one, and no data options.
        printf 'port %s\nbind %s\ndaemonize yes\npidfile %s\nlogfile %s\ndir %s\n%s\n' "$port" "$HOST" \
            "$dir/redis.pid" "$dir/redis.log" "$dir" "$2" >"$dir/sentinel.conf"
        server=(redis-server "$dir/sentinel.conf" --sentinel)
    fi
    "${server[@]}" </dev/null >"$dir/redis.out" 2>&1 ||
        { cat "$dir/redis.out" "$dir/redis.log" >&2 2>/dev/null; die "redis-server failed to start"; }
    deadline=$((SECONDS + ${REDIS_START_TIMEOUT:-20}))
    while ((SECONDS < deadline)); do
        [[ -z "$pid" && -s "$dir/redis.pid" ]] && pid="$(cat "$dir/redis.pid")"
        if [[ "$(redis-cli -h "$HOST" -p "$port" ping 2>/dev/null)" == PONG ]]; then
            echo "$port" >"$dir/port"
            echo "redis://$HOST:$port/0" >"$dir/url"
            return 0
        fi
        if grep -qi 'address already in use' "$dir/redis.log" 2>/dev/null; then
            return 2
        fi
        if [[ -n "$pid" ]] && ! pid_alive "$pid"; then
            tail -n 20 "$dir/redis.log" >&2 2>/dev/null || true
            die "redis-server (pid $pid) exited during startup"
        fi
        sleep 0.1
    done
    [[ -n "$pid" ]] && kill -KILL "$pid" 2>/dev/null || true
    tail -n 20 "$dir/redis.log" >&2 2>/dev/null || true
    die "redis-server did not answer PING on $HOST:$port within ${REDIS_START_TIMEOUT:-20}s"
}

# start_fresh DIR [redis-server args...]: a new server in DIR on a free port (bounded retries).
start_fresh() {
    local dir="$1" attempt rc
    shift
    mkdir -p "$dir"
    rm -rf "$dir/appendonly"
    for attempt in 1 2 3; do
        rc=0
        start_once "$dir" "" "$@" || rc=$?
        [[ $rc -eq 0 ]] && return 0
        log "port taken by another process while starting (attempt $attempt), retrying"
    done
    die "could not bind a free port after 3 attempts"
}

# Ready when the replica is in sync and every Sentinel knows it and the others (else nobody to promote,
# or no quorum to agree the primary is down).
failover_ready() {
    local dir="$1" i port
    for i in 1 2; do
        redis-cli -h "$HOST" -p "$(cat "$dir/replica-$i/port")" info replication | grep -q 'master_link_status:up' ||
            return 1
    done
    for i in 1 2 3; do
        port="$(cat "$dir/sentinel-$i/port")"
        redis-cli -h "$HOST" -p "$port" sentinel master rein | grep -qx 'num-slaves' || return 1
        [[ "$(redis-cli -h "$HOST" -p "$port" sentinel master rein | grep -A1 -x 'num-slaves' | tail -n 1)" -ge 2 ]] || return 1
        [[ "$(redis-cli -h "$HOST" -p "$port" sentinel master rein | grep -A1 -x 'num-other-sentinels' | tail -n 1)" -ge 2 ]] || return 1
    done
}

# A primary, two replicas and three Sentinels under DIR.
start_failover() {
    local dir="$1" primary i sentinels=() deadline
    start_fresh "$dir/primary"
    primary="$(cat "$dir/primary/port")"
    for i in 1 2; do start_fresh "$dir/replica-$i" --replicaof "$HOST" "$primary"; done
    for i in 1 2 3; do
        start_fresh "$dir/sentinel-$i" --sentinel "sentinel monitor rein $HOST $primary 2
sentinel down-after-milliseconds rein 1000
sentinel failover-timeout rein 10000
sentinel parallel-syncs rein 1"
        sentinels+=("$HOST:$(cat "$dir/sentinel-$i/port")")
    done
    deadline=$((SECONDS + ${REDIS_START_TIMEOUT:-20}))
    until failover_ready "$dir"; do
        ((SECONDS < deadline)) || die "the replica or the Sentinels did not come up within ${REDIS_START_TIMEOUT:-20}s"
        sleep 0.2
    done
    echo failover >"$dir/layout"
    cp "$dir/primary/url" "$dir/url"
    (IFS=,; echo "${sentinels[*]}") >"$dir/sentinels"
    report "$dir/primary"
    echo "sentinels=$(cat "$dir/sentinels")"
    echo "master=rein"
}

cmd_start() {
    local dir="${1:-}"
    [[ -n "$dir" ]] || die "usage: redis.sh start DATA_DIR [--failover]"
    need_redis
    if [[ "${2:-}" == --failover ]]; then
        mkdir -p "$dir"
        start_failover "$(cd "$dir" && pwd)"
        return 0
    fi
    mkdir -p "$dir"
    dir="$(cd "$dir" && pwd)"
    if [[ -f "$dir/redis.pid" ]] && pid_alive "$(cat "$dir/redis.pid")" && is_redis "$(cat "$dir/redis.pid")"; then
        die "a redis-server is already running for $dir (pid $(cat "$dir/redis.pid")); run: redis.sh stop $dir"
    fi
    start_fresh "$dir"
    report "$dir"
}

report() {
    local dir="$1" version
    version="$(redis-cli -h "$HOST" -p "$(cat "$dir/port")" info server | tr -d '\r' |
        sed -n 's/^redis_version://p')"
    echo "$version" >"$dir/version"
    echo "url=$(cat "$dir/url")"
    echo "version=$version"
    log "Redis $version up on $(cat "$dir/url"), pid $(cat "$dir/redis.pid"), dir $dir"
}

cmd_kill() {
    local dir="${1:-}"
    [[ -n "$dir" && -d "$dir" ]] || die "usage: redis.sh kill DATA_DIR (one server's directory)"
    kill_pidfile "$dir/redis.pid" redis-server is_redis
}

cmd_stop() {
    local dir="${1:-}" part
    [[ -n "$dir" ]] || die "usage: redis.sh stop DATA_DIR"
    if [[ "$(cat "$dir/layout" 2>/dev/null)" == failover ]]; then
        for part in sentinel-1 sentinel-2 sentinel-3 replica-1 replica-2 primary; do cmd_stop "$dir/$part"; done
        return 0
    fi
    [[ -f "$dir/redis.pid" ]] || { log "no pid file in $dir: nothing to stop"; return 0; }
    stop_pidfile "$dir/redis.pid" redis-server "${REDIS_STOP_TIMEOUT:-10}" is_redis
}

cmd_restart() {
    local dir="${1:-}" how="${2:-}" pid port rc=0
    [[ -n "$dir" && -f "$dir/port" ]] || die "usage: redis.sh restart DATA_DIR [--kill] (DATA_DIR of a started server)"
    dir="$(cd "$dir" && pwd)"
    port="$(cat "$dir/port")"
    if [[ "$how" == --kill ]]; then
        cmd_kill "$dir"
    else
        cmd_stop "$dir"
    fi
    sleep "${RESTART_DOWN_S:-0}"
    start_once "$dir" "$port" || rc=$?
    [[ $rc -eq 0 ]] || die "could not start redis-server again on port $port (taken meanwhile?)"
    report "$dir"
}

case "${1:-}" in
install) cmd_install ;;
start) cmd_start "${2:-}" "${3:-}" ;;
stop) cmd_stop "${2:-}" ;;
restart) cmd_restart "${2:-}" "${3:-}" ;;
kill) cmd_kill "${2:-}" ;;
*)
    echo "usage: $0 {install|start DATA_DIR [--failover]|stop DATA_DIR|restart DATA_DIR [--kill]|kill DATA_DIR}" >&2
    exit 2
    ;;
esac
