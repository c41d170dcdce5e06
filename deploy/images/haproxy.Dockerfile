# rein-local/haproxy:2.6 — Debian's HAProxy 2.6, run like the official haproxy:2.6 image: as the haproxy
# user, the compose file's `command` (a shell that writes the configuration, then haproxy in the foreground).
ARG DEBIAN_IMAGE=rein-local/debian:bookworm
FROM ${DEBIAN_IMAGE}
RUN apt-get update -q \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends haproxy \
    && rm -rf /var/lib/apt/lists/*
USER haproxy
CMD ["haproxy", "-db", "-f", "/usr/local/etc/haproxy/haproxy.cfg"]
