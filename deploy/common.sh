# Sourced by the deploy scripts: what they all do the same way (messages, Debian packages, local ports,
# the processes they start and stop).
#
#   die MESSAGE / log MESSAGE        "SCRIPT: error: MESSAGE" (then exit 1) / "SCRIPT: MESSAGE" on stderr
#   apt_install COMMAND PACKAGE...   nothing when COMMAND is on PATH; else apt-get update and install the
#                                    packages (as root, or through sudo), then insist COMMAND is there
#   free_ports N                     N distinct free TCP ports on 127.0.0.1 (see ops/local/ports.py)
#   pid_alive PID                    PID runs and is not a zombie
#   stop_pidfile FILE WHAT TIMEOUT IS_OURS [ARG...]
#                                    stop the process FILE names (TERM, TIMEOUT seconds, then KILL) and
#                                    remove FILE; left alone unless `IS_OURS PID ARG...` (a recycled pid)
#   kill_pidfile FILE WHAT IS_OURS [ARG...]
#                                    the same with SIGKILL at once (a crash)

DEPLOY_LIB="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SCRIPT="${0##*/}"

die() {
    echo "$SCRIPT: error: $*" >&2
    exit 1
}
log() { echo "$SCRIPT: $*" >&2; }

apt_install() {
    local command="$1" sudo=()
    shift
    command -v "$command" >/dev/null 2>&1 && return 0
    command -v apt-get >/dev/null 2>&1 ||
        die "$command is not installed and apt-get is unavailable: install $* by hand ($command on PATH)"
    if [[ $EUID -ne 0 ]]; then
        command -v sudo >/dev/null 2>&1 || die "$command is missing and installing $* needs root (no sudo found)"
        sudo=(sudo)
    fi
    echo "installing $* with apt-get ..." >&2
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 update -q >&2 ||
        die "apt-get update failed"
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -q \
        --no-install-recommends "$@" >&2 || die "apt-get install $* failed"
    command -v "$command" >/dev/null 2>&1 || die "apt-get installed $* but $command is still not on PATH"
}

# Below the ephemeral range; REIN_PORT_BLOCK=I/N (parallel test workers): from block I of N of it only.
free_ports() { python3 "$DEPLOY_LIB/../ops/local/ports.py" "$1" ${REIN_PORT_BLOCK:+--block "$REIN_PORT_BLOCK"}; }

# An unreaped zombie still answers kill -0.
pid_alive() {
    [[ -n "$1" ]] && kill -0 "$1" 2>/dev/null || return 1
    [[ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" != "Z" ]]
}

stop_pidfile() {
    local file="$1" what="$2" timeout="$3" is_ours="$4" pid deadline
    shift 4
    pid="$(cat "$file" 2>/dev/null || true)"
    if ! pid_alive "$pid" || ! "$is_ours" "$pid" "$@"; then
        log "$what ${pid:+pid $pid }is not running"
        rm -f "$file"
        return 0
    fi
    kill -TERM "$pid" 2>/dev/null || true
    deadline=$((SECONDS + timeout))
    while pid_alive "$pid" && ((SECONDS < deadline)); do sleep 0.1; done
    if pid_alive "$pid"; then
        log "$what pid $pid ignored SIGTERM for ${timeout}s: SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
        while pid_alive "$pid"; do sleep 0.1; done
    fi
    rm -f "$file"
    log "$what pid $pid stopped"
}

kill_pidfile() {
    local file="$1" what="$2" is_ours="$3" pid
    shift 3
    pid="$(cat "$file" 2>/dev/null || true)"
    if pid_alive "$pid" && "$is_ours" "$pid" "$@"; then
        kill -KILL "$pid"
        while pid_alive "$pid"; do sleep 0.05; done
        log "$what pid $pid killed"
    fi
    rm -f "$file"
}
