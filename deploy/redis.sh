#!/usr/bin/env bash
# A throwaway Redis from the OS package, for `make demo` and the test fixtures.
#
#   deploy/redis.sh install          apt-get install redis-server if it is missing
#   deploy/redis.sh start DATA_DIR   start a fresh redis-server (empty data) on a free 127.0.0.1 port
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
HOST=127.0.0.1

die() {
    echo "redis.sh: error: $*" >&2
    exit 1
}
log() { echo "redis.sh: $*" >&2; }

cmd_install() {
    if command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1; then
        log "$(redis-server --version | cut -d' ' -f1-3) already installed"
        return 0
    fi
    command -v apt-get >/dev/null 2>&1 ||
        die "redis-server is not installed and apt-get is unavailable: install Redis 6+ by hand (redis-server and redis-cli on PATH)"
    local sudo=()
    if [[ $EUID -ne 0 ]]; then
        command -v sudo >/dev/null 2>&1 || die "redis-server is missing and installing it needs root (no sudo found)"
        sudo=(sudo)
    fi
    log "installing redis-server with apt-get ..."
    export DEBIAN_FRONTEND=noninteractive
    "${sudo[@]}" apt-get -o DPkg::Lock::Timeout=600 update -q >&2 || die "apt-get update failed"
    "${sudo[@]}" apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends redis-server redis-tools >&2 ||
        die "apt-get install redis-server failed"
    command -v redis-server >/dev/null 2>&1 || die "apt-get ran but redis-server is still not on PATH"
}

need_redis() {
    command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1 ||
        die "redis-server/redis-cli not found on PATH: run deploy/redis.sh install (or apt-get install -y redis-server)"
}

# A free TCP port on 127.0.0.1, below the ephemeral range (see ops/local/ports.py).
free_port() { python3 "$HERE/../ops/local/ports.py" 1; }

# Alive and not a zombie (an unreaped zombie still answers kill -0).
pid_alive() {
    [[ -n "$1" ]] && kill -0 "$1" 2>/dev/null || return 1
    [[ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" != "Z" ]]
}

# True when PID is a redis-server (guards against a recycled pid).
is_redis() { [[ -r "/proc/$1/comm" ]] && grep -q '^redis-server' "/proc/$1/comm"; }

# One attempt: 0 = up, 2 = the port was taken meanwhile (retry), else die.
# PORT (optional) is the port to reuse on a restart; without it a free one is picked.
start_once() {
    local dir="$1" port="${2:-}" deadline pid=""
    [[ -n "$port" ]] || port="$(free_port)"
    rm -f "$dir/redis.pid" "$dir/redis.log"
    redis-server --bind "$HOST" --port "$port" --save '' --dir "$dir" \
        --appendonly yes --appendfsync always --appenddirname appendonly \
        --daemonize yes --pidfile "$dir/redis.pid" --logfile "$dir/redis.log" \
        --databases 64 --protected-mode yes </dev/null >"$dir/redis.out" 2>&1 ||
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

cmd_start() {
    local dir="${1:-}"
    [[ -n "$dir" ]] || die "usage: redis.sh start DATA_DIR"
    need_redis
    mkdir -p "$dir"
    dir="$(cd "$dir" && pwd)"
    if [[ -f "$dir/redis.pid" ]] && pid_alive "$(cat "$dir/redis.pid")" && is_redis "$(cat "$dir/redis.pid")"; then
        die "a redis-server is already running for $dir (pid $(cat "$dir/redis.pid")); run: redis.sh stop $dir"
    fi
    rm -rf "$dir/appendonly"
    local attempt rc
    for attempt in 1 2 3; do
        rc=0
        start_once "$dir" || rc=$?
        [[ $rc -eq 0 ]] && break
        log "port taken by another process while starting (attempt $attempt), retrying"
    done
    [[ $rc -eq 0 ]] || die "could not bind a free port after 3 attempts"
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

cmd_stop() {
    local dir="${1:-}" pid deadline
    [[ -n "$dir" ]] || die "usage: redis.sh stop DATA_DIR"
    [[ -f "$dir/redis.pid" ]] || { log "no pid file in $dir: nothing to stop"; return 0; }
    pid="$(cat "$dir/redis.pid")"
    if ! pid_alive "$pid" || ! is_redis "$pid"; then
        log "redis-server pid $pid is not running"
        rm -f "$dir/redis.pid"
        return 0
    fi
    kill -TERM "$pid" 2>/dev/null || true
    deadline=$((SECONDS + ${REDIS_STOP_TIMEOUT:-10}))
    while pid_alive "$pid" && ((SECONDS < deadline)); do sleep 0.1; done
    if pid_alive "$pid"; then
        log "redis-server pid $pid ignored SIGTERM: SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
        while pid_alive "$pid"; do sleep 0.1; done
    fi
    rm -f "$dir/redis.pid"
    log "redis-server pid $pid stopped"
}

cmd_restart() {
    local dir="${1:-}" how="${2:-}" pid port rc=0
    [[ -n "$dir" && -f "$dir/port" ]] || die "usage: redis.sh restart DATA_DIR [--kill] (DATA_DIR of a started server)"
    dir="$(cd "$dir" && pwd)"
    port="$(cat "$dir/port")"
    if [[ "$how" == --kill ]]; then
        pid="$(cat "$dir/redis.pid" 2>/dev/null || true)"
        if [[ -n "$pid" ]] && pid_alive "$pid" && is_redis "$pid"; then
            kill -KILL "$pid"
            while pid_alive "$pid"; do sleep 0.05; done
            log "redis-server pid $pid killed"
        fi
        rm -f "$dir/redis.pid"
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
start) cmd_start "${2:-}" ;;
stop) cmd_stop "${2:-}" ;;
restart) cmd_restart "${2:-}" "${3:-}" ;;
*)
    echo "usage: $0 {install|start DATA_DIR|stop DATA_DIR|restart DATA_DIR [--kill]}" >&2
    exit 2
    ;;
esac
