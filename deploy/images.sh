#!/usr/bin/env bash
# The images docker-compose.yml needs, built without a registry of images (none is reachable here):
#
#   deploy/images.sh build    build every local image below (layers cached: a second build takes seconds)
#
#   rein-local/debian:bookworm    a Debian root filesystem from debootstrap, `docker import`ed
#   rein-local/python:3.11        + Debian's Python: what python:3.11-slim gives the Dockerfile
#   rein-local/kafka:<version>    + Java 17 and the Maven jars of deploy/kafka.sh, configured as apache/kafka
#   rein-local/redis:7            + Debian's redis-server, started as redis:7
#   rein-local/prometheus:debian  + Debian's Prometheus, started as prom/prometheus
#   rein-local/haproxy:2.6        + Debian's HAProxy, started as haproxy:2.6 (the proxies' balancer)
#   rein:local                    ./Dockerfile on rein-local/python:3.11, every wheel from a local index
#
# The compose file keeps the official images as defaults; `docker compose --env-file deploy/images/local.env`
# (or the same variables in the shell) swaps these in, so both run the same configuration.
# rein's wheels: pip downloads the dependency closure of pyproject.toml on the host once (pip's cache
# makes that free after `make venv`) into ${REIN_CACHE:-~/.cache/rein}/wheelhouse-<hash>, served as a
# simple index on 127.0.0.1:${REIN_WHEELS_PORT:-18631} while the image builds (--network host). torch
# there is PyPI's CUDA build (several GB): PyTorch's CPU index is not reachable from these machines.
#
# Needs a running Docker engine (deploy/docker.sh start) and root for debootstrap.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
# shellcheck source=deploy/common.sh
source "$HERE/common.sh"
CACHE="${REIN_CACHE:-$HOME/.cache/rein}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SUITE=bookworm
WHEELS_PORT="${REIN_WHEELS_PORT:-18631}"

kafka_version() { bash "$HERE/kafka.sh" version; }

image_exists() { docker image inspect "$1" >/dev/null 2>&1; }

build_debian() {
    local tag="rein-local/debian:$SUITE"
    if image_exists "$tag"; then
        log "$tag present"
        return 0
    fi
    [[ $EUID -eq 0 ]] || die "debootstrap needs root"
    apt_install debootstrap debootstrap
    local root
    root="$(mktemp -d "$CACHE/debootstrap.XXXXXX")"
    # shellcheck disable=SC2064  # expand now: the path is fixed
    trap "rm -rf '$root'" EXIT
    log "debootstrap $SUITE (minbase) from $MIRROR ..."
    debootstrap --variant=minbase "$SUITE" "$root" "$MIRROR" >"$root.log" 2>&1 || {
        tail -n 30 "$root.log" >&2
        die "debootstrap failed (log: $root.log)"
    }
    rm -f "$root.log"
    # The same suites as the host's: security and point-release updates too.
    printf 'deb %s %s main\ndeb %s %s-updates main\ndeb http://deb.debian.org/debian-security %s-security main\n' \
        "$MIRROR" "$SUITE" "$MIRROR" "$SUITE" "$SUITE" >"$root/etc/apt/sources.list"
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    tar -C "$root" -c . | docker import --change 'CMD ["bash"]' - "$tag" >/dev/null
    rm -rf "$root"
    trap - EXIT
    log "$tag imported"
}

# docker build TAG DOCKERFILE CONTEXT [ARGS...] (the legacy builder: Debian's engine has no buildx)
build() {
    local tag="$1" dockerfile="$2" context="$3"
    shift 3
    log "building $tag ..."
    local t0=$SECONDS
    DOCKER_BUILDKIT=0 docker build -q -t "$tag" -f "$dockerfile" "$@" "$context" >/dev/null 2>"$CACHE/images-build.log" || {
        tail -n 40 "$CACHE/images-build.log" >&2
        die "building $tag failed"
    }
    log "$tag built in $((SECONDS - t0))s ($(docker image inspect -f '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1/1e6}'))"
}

build_python() {
    local ctx
    ctx="$(mktemp -d)"
    cp /etc/ssl/certs/ca-certificates.crt "$ctx/"
    build rein-local/python:3.11 "$HERE/images/python.Dockerfile" "$ctx"
    rm -rf "$ctx"
}

build_kafka() {
    local version ctx
    version="$(kafka_version)"
    bash "$HERE/kafka.sh" fetch
    ctx="$(mktemp -d)"
    cp -r "$CACHE/kafka-$version/libs" "$ctx/libs"
    cp -r "$HERE/images/kafka-bin" "$ctx/bin"
    cp "$HERE/images/kafka-run" "$ctx/run"
    cp "$HERE/images/kafka-log4j2.properties" "$ctx/log4j2.properties"
    cp "$HERE/images/kafka-tools-log4j2.properties" "$ctx/tools-log4j2.properties"
    build "rein-local/kafka:$version" "$HERE/images/kafka.Dockerfile" "$ctx"
    rm -rf "$ctx"
}

build_redis() { build rein-local/redis:7 "$HERE/images/redis.Dockerfile" "$HERE/images"; }

build_prometheus() { build rein-local/prometheus:debian "$HERE/images/prometheus.Dockerfile" "$HERE/images"; }

build_haproxy() { build rein-local/haproxy:2.6 "$HERE/images/haproxy.Dockerfile" "$HERE/images"; }

# The wheelhouse: pyproject.toml's dependencies and the build backend, resolved by the image's own
# Python (its markers: Debian's 3.11.2 needs wheels the host's Python may not), laid out as a PEP 503
# index (simple/<project>/<file>) that `python3 -m http.server` lists. Keyed by the spec and that Python.
wheelhouse() {
    local spec hash wh py
    spec="$(python3 -c '
import sys, tomllib
doc = tomllib.load(open(sys.argv[1], "rb"))
print("\n".join(doc["project"]["dependencies"] + doc["build-system"]["requires"] + ["wheel"]))
' "$REPO/pyproject.toml")"
    py="$(docker run --rm rein-local/python:3.11 python --version)"
    hash="$(sha256sum <<<"$py $spec" | cut -c1-12)"
    wh="$CACHE/wheelhouse-$hash"
    if [[ ! -f "$wh/.complete" ]]; then
        log "downloading rein's dependency closure for $py into $wh (torch's CUDA build: several GB) ..."
        rm -rf "$wh/simple"
        mapfile -t reqs <<<"$spec"
        docker run --rm --network host -v "$wh/files:/wheels" rein-local/python:3.11 \
            pip download -q --progress-bar off -d /wheels "${reqs[@]}" >&2 ||
            die "pip download of rein's dependencies failed"
        python3 - "$wh" <<'PY'
import os, re, sys
wh = sys.argv[1]
for name in os.listdir(f"{wh}/files"):
    stem = name[: -len(".whl")].split("-")[0] if name.endswith(".whl") else re.sub(r"\.(tar\.gz|zip)$", "", name).rsplit("-", 1)[0]
    project = re.sub(r"[-_.]+", "-", stem).lower()
    os.makedirs(f"{wh}/simple/{project}", exist_ok=True)
    os.symlink(f"../../files/{name}", f"{wh}/simple/{project}/{name}")
PY
        touch "$wh/.complete"
    fi
    echo "$wh"
}

build_rein() {
    local wh server
    wh="$(wheelhouse)"
    (exec 3<>"/dev/tcp/127.0.0.1/$WHEELS_PORT") 2>/dev/null &&
        die "127.0.0.1:$WHEELS_PORT is taken: set REIN_WHEELS_PORT to a free port (a fixed port keeps the layer cache)"
    python3 -m http.server --bind 127.0.0.1 --directory "$wh" "$WHEELS_PORT" >/dev/null 2>&1 &
    server=$!
    # shellcheck disable=SC2064  # the server goes with the script, however it ends
    trap "kill $server 2>/dev/null || true" EXIT
    local deadline=$((SECONDS + 20))
    until (exec 3<>"/dev/tcp/127.0.0.1/$WHEELS_PORT") 2>/dev/null; do
        ((SECONDS < deadline)) || die "the wheel index did not start on 127.0.0.1:$WHEELS_PORT"
        sleep 0.2
    done
    local index="http://127.0.0.1:$WHEELS_PORT/simple"
    build rein:local "$REPO/Dockerfile" "$REPO" --network host --build-arg PYTHON_IMAGE=rein-local/python:3.11 \
        --build-arg TORCH_INDEX_URL="$index" --build-arg PIP_INDEX_URL="$index"
}

cmd_build() {
    docker info >/dev/null 2>&1 || die "no Docker engine answers: run deploy/docker.sh install && deploy/docker.sh start"
    mkdir -p "$CACHE"
    local t0=$SECONDS
    build_debian
    build_python
    build_kafka
    build_redis
    build_prometheus
    build_haproxy
    build_rein
    log "all images ready in $((SECONDS - t0))s"
}

case "${1:-}" in
build) cmd_build ;;
*) die "usage: images.sh build" ;;
esac
