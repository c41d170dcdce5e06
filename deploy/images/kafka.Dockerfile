# rein-local/kafka:<version> — Apache Kafka from the Maven jars deploy/kafka.sh resolves, on Debian's
# Java 17, configured like the official apache/kafka image: every KAFKA_* variable of the compose file
# becomes a server property, CLUSTER_ID formats the KRaft log once, the broker logs to stdout, and
# /opt/kafka/bin has the tools the healthcheck calls.
ARG DEBIAN_IMAGE=rein-local/debian:bookworm
FROM ${DEBIAN_IMAGE}
RUN apt-get update -q \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends openjdk-17-jre-headless \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 1000 --user-group --no-create-home --home-dir /opt/kafka appuser \
    && mkdir -p /opt/kafka/config /var/lib/kafka/data \
    && chown -R appuser:appuser /opt/kafka/config /var/lib/kafka/data
COPY libs /opt/kafka/libs
COPY bin /opt/kafka/bin
COPY run /etc/kafka/docker/run
COPY log4j2.properties tools-log4j2.properties /opt/kafka/config/
VOLUME /var/lib/kafka/data
EXPOSE 9092
USER appuser
CMD ["/etc/kafka/docker/run"]
