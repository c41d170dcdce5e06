#!/usr/bin/env bash
# HAProxy (Debian's package) as the session-affine load balancer in front of several rein proxies.
#
#   deploy/haproxy.sh install                      apt-get install haproxy if it is missing
#   deploy/haproxy.sh start DATA_DIR HOST:PORT...  HAProxy on a free 127.0.0.1 port in front of those
#                                                  proxies (deploy/haproxy/rein.cfg.in); prints
#                                                  `url=http://127.0.0.1:PORT` and `admin=SOCKET` (its
#                                                  runtime API)
#   deploy/haproxy.sh stop DATA_DIR                stop it (TERM, bounded wait, then KILL)
#
# Knobs (environment, optional): HAPROXY_START_TIMEOUT (seconds, default 10).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=deploy/common.sh
source "$HERE/common.sh"
HOST=127.0.0.1

cmd_install() {
    if command -v haproxy >/dev/null 2>&1; then
        log "$(haproxy -v | head -n 1 | cut -d' ' -f1-3) already installed"
        return 0
    fi
    apt_install haproxy haproxy
}

is_haproxy() { grep -q haproxy "/proc/$1/comm" 2>/dev/null; }

cmd_start() {
    local dir="${1:-}" port servers="" i=0 target deadline
    [[ -n "$dir" && $# -ge 2 ]] || die "usage: haproxy.sh start DATA_DIR HOST:PORT..."
    shift
    command -v haproxy >/dev/null 2>&1 || die "haproxy not found: run deploy/haproxy.sh install"
    mkdir -p "$dir"
    dir="$(cd "$dir" && pwd)"
    for target in "$@"; do
        [[ "$target" =~ ^[^:/]+:[0-9]+$ ]] || die "not HOST:PORT: $target"
        servers+="    server p$i $target"$'\n'
        i=$((i + 1))
    done
    port="$(free_ports 1)"
    # the runtime API's socket: in DATA_DIR unless that path is too long for a Unix socket (108 bytes)
    admin="$dir/admin.sock"
    ((${#admin} <= 100)) || admin="${TMPDIR:-/tmp}/rein-haproxy-$port.sock"
    sed -e "s|@BIND@|$HOST:$port|" -e "s|@DIR@|$dir|" -e "s|@ADMIN@|$admin|" "$HERE/haproxy/rein.cfg.in" |
        awk -v servers="$servers" '{ if ($0 == "@SERVERS@") printf "%s", servers; else print }' >"$dir/haproxy.cfg"
    haproxy -c -q -f "$dir/haproxy.cfg" || die "invalid configuration $dir/haproxy.cfg"
    rm -f "$dir/haproxy.pid"
    haproxy -f "$dir/haproxy.cfg" >"$dir/haproxy.log" 2>&1 || { cat "$dir/haproxy.log" >&2; die "haproxy did not start"; }
    deadline=$((SECONDS + ${HAPROXY_START_TIMEOUT:-10}))
    until [[ -s "$dir/haproxy.pid" ]] && (exec 3<>"/dev/tcp/$HOST/$port") 2>/dev/null; do
        ((SECONDS < deadline)) || die "haproxy did not listen on $HOST:$port within ${HAPROXY_START_TIMEOUT:-10}s"
        sleep 0.1
    done
    echo "http://$HOST:$port" >"$dir/url"
    echo "$admin" >"$dir/admin"
    echo "url=http://$HOST:$port"
    echo "admin=$admin"
    log "HAProxy on http://$HOST:$port in front of $*, pid $(cat "$dir/haproxy.pid")"
}

cmd_stop() {
    local dir="${1:-}"
    [[ -n "$dir" ]] || die "usage: haproxy.sh stop DATA_DIR"
    stop_pidfile "$dir/haproxy.pid" haproxy 10 is_haproxy
    [[ ! -s "$dir/admin" ]] || rm -f "$(cat "$dir/admin")"  # HAProxy leaves its socket behind
}

case "${1:-}" in
install) cmd_install ;;
start) shift; cmd_start "$@" ;;
stop) cmd_stop "${2:-}" ;;
*) die "usage: haproxy.sh install | start DATA_DIR HOST:PORT... | stop DATA_DIR" ;;
esac
