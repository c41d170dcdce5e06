# rein-local/redis:7 — Debian's redis-server (7.0), started like the official redis:7 image:
# the compose file's `command` (redis-server and its flags) runs as the redis user in /data,
# and a container is reachable from the compose network (protected mode off, as the official
# image does when no configuration file is given).
ARG DEBIAN_IMAGE=rein-local/debian:bookworm
FROM ${DEBIAN_IMAGE}
RUN apt-get update -q \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends redis-server redis-tools \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /data && chown redis:redis /data
COPY redis-entrypoint.sh /usr/local/bin/docker-entrypoint.sh
WORKDIR /data
VOLUME /data
EXPOSE 6379
USER redis
ENTRYPOINT ["docker-entrypoint.sh"]
CMD ["redis-server"]
