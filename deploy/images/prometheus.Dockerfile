# rein-local/prometheus — Debian's Prometheus (2.42), run like prom/prometheus: the compose file's
# `command` is the server's flags; wget answers the healthcheck as busybox's does in the official image.
ARG DEBIAN_IMAGE=rein-local/debian:bookworm
FROM ${DEBIAN_IMAGE}
RUN apt-get update -q \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus wget \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /prometheus && chown prometheus:prometheus /prometheus
WORKDIR /prometheus
VOLUME /prometheus
EXPOSE 9090
USER prometheus
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
