#!/bin/sh
# Runs one of Kafka's tool classes with the broker's jars; tool logging goes to stderr, warnings only.
exec java -Xmx256m -Dlog4j2.configurationFile=/opt/kafka/config/tools-log4j2.properties -cp '/opt/kafka/libs/*' "$@"
