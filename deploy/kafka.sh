#!/usr/bin/env bash
# A real single-node Apache Kafka (KRaft, combined broker + controller) without Docker.
#
#   deploy/kafka.sh fetch            resolve the broker jars from Maven Central into the cache
#   deploy/kafka.sh start DATA_DIR   format a fresh KRaft log in DATA_DIR and start a broker on free ports
#   deploy/kafka.sh stop DATA_DIR    stop the broker started in DATA_DIR (TERM, bounded wait, then KILL)
#   deploy/kafka.sh restart DATA_DIR [--kill]
#                                    stop it (--kill: SIGKILL, a crash) and start it again with its data
#                                    on the same ports (the fault tests use this); RESTART_DOWN_S=N
#                                    in the environment leaves it down N seconds in between
#   deploy/kafka.sh version          print the Kafka version deploy/kafka/pom.xml pins
#
# The jars live outside the checkout, in ${REIN_CACHE:-$HOME/.cache/rein}/kafka-<version>/libs,
# with a .complete marker so an interrupted download is redone. Maven keeps its own ~/.m2 cache.
#
# After `start`, DATA_DIR holds: server.properties, log4j2.properties, pid, bootstrap (host:port),
# controller (host:port), version, logs/server.log, logs/kafkaServer.out and the KRaft log dirs.
# `start` prints two lines: `bootstrap=HOST:PORT` and `version=X.Y.Z` (the version the broker logged).
#
# Knobs (environment, all optional): REIN_CACHE, KAFKA_HEAP_OPTS (default -Xmx512m -Xms256m),
# KAFKA_JVM_OPTS (extra JVM flags), KAFKA_START_TIMEOUT (seconds, default 90),
# KAFKA_STOP_TIMEOUT (seconds, default 30).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
POM="$HERE/kafka/pom.xml"
CACHE="${REIN_CACHE:-$HOME/.cache/rein}"
HOST=127.0.0.1

die() {
    echo "kafka.sh: error: $*" >&2
    exit 1
}
log() { echo "kafka.sh: $*" >&2; }

kafka_version() {
    local v
    v="$(sed -n 's:.*<kafka.version>\([^<]*\)</kafka.version>.*:\1:p' "$POM" | head -n 1)"
    [[ -n "$v" ]] || die "cannot read <kafka.version> from $POM"
    echo "$v"
}

KAFKA_VERSION="$(kafka_version)"
KAFKA_HOME="$CACHE/kafka-$KAFKA_VERSION"
LIBS="$KAFKA_HOME/libs"

need_java() {
    command -v java >/dev/null 2>&1 ||
        die "java not found on PATH: install a JDK 17+ (Debian: apt-get install -y openjdk-17-jre-headless)"
}

# The marker holds a hash of the pom, so editing the pom re-resolves the jars.
pom_hash() { sha256sum "$POM" | cut -c1-16; }

cmd_fetch() {
    need_java
    local want
    want="$(pom_hash)"
    if [[ -f "$KAFKA_HOME/.complete" && "$(cat "$KAFKA_HOME/.complete")" == "$want" ]]; then
        log "Kafka $KAFKA_VERSION jars cached in $LIBS"
        return 0
    fi
    command -v mvn >/dev/null 2>&1 ||
        die "mvn not found on PATH: install Maven 3.8+ (Debian: apt-get install -y maven) to fetch the Kafka jars"
    mkdir -p "$KAFKA_HOME"
    # One fetch at a time per version (two test runs may start together). The lock fd is closed
    # again before returning so that a broker started afterwards does not inherit it.
    exec 9>"$KAFKA_HOME/.lock"
    flock 9
    if [[ -f "$KAFKA_HOME/.complete" && "$(cat "$KAFKA_HOME/.complete")" == "$want" ]]; then
        exec 9>&-
        return 0
    fi
    rm -f "$KAFKA_HOME/.complete"
    rm -rf "$LIBS" "$LIBS.partial"
    log "resolving Kafka $KAFKA_VERSION jars from Maven Central into $LIBS ..."
    if ! mvn -q -B -f "$POM" dependency:copy-dependencies \
        -DincludeScope=runtime -DoutputDirectory="$LIBS.partial" >"$KAFKA_HOME/mvn.log" 2>&1; then
        tail -n 40 "$KAFKA_HOME/mvn.log" >&2
        die "mvn could not resolve the Kafka jars (full log: $KAFKA_HOME/mvn.log)"
    fi
    [[ -f "$LIBS.partial/kafka_2.13-$KAFKA_VERSION.jar" ]] ||
        die "mvn finished but kafka_2.13-$KAFKA_VERSION.jar is missing from $LIBS.partial"
    mv "$LIBS.partial" "$LIBS"
    echo "$want" >"$KAFKA_HOME/.complete"
    exec 9>&-
    log "Kafka $KAFKA_VERSION jars ready ($(ls "$LIBS" | wc -l) jars)"
}

# Prints N distinct free TCP ports on 127.0.0.1, below the ephemeral range (see ops/local/ports.py).
free_ports() { python3 "$HERE/../ops/local/ports.py" "$1"; }

# A Kafka Uuid: 16 random bytes, url-safe base64 without padding, never starting with '-'.
random_cluster_id() {
    python3 -c '
import base64, os
while True:
    s = base64.urlsafe_b64encode(os.urandom(16)).decode().rstrip("=")
    if not s.startswith("-"):
        print(s)
        break
'
}

port_open() { (exec 3<>"/dev/tcp/$HOST/$1") 2>/dev/null; }

# Alive and not a zombie (an unreaped zombie still answers kill -0).
pid_alive() {
    [[ -n "$1" ]] && kill -0 "$1" 2>/dev/null || return 1
    [[ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" != "Z" ]]
}

# True when PID is a kafka.Kafka JVM started for DATA_DIR (guards against a recycled pid).
is_our_broker() {
    local pid="$1" dir="$2"
    [[ -r "/proc/$pid/cmdline" ]] || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q "kafka.Kafka $dir/server.properties"
}

write_config() {
    local dir="$1" port="$2" cport="$3"
    cat >"$dir/server.properties" <<EOF
# Written by deploy/kafka.sh: single-node KRaft, broker and controller in one JVM.
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@$HOST:$cport
listeners=PLAINTEXT://$HOST:$port,CONTROLLER://$HOST:$cport
advertised.listeners=PLAINTEXT://$HOST:$port
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
log.dirs=$dir/kraft-logs
num.partitions=4
default.replication.factor=1
min.insync.replicas=1
auto.create.topics.enable=false
delete.topic.enable=true
offsets.topic.replication.factor=1
offsets.topic.num.partitions=8
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=4
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
num.network.threads=2
num.io.threads=4
num.recovery.threads.per.data.dir=1
log.retention.hours=168
EOF
    cat >"$dir/log4j2.properties" <<'EOF'
# Written by deploy/kafka.sh: everything to logs/server.log, quiet request/state-change chatter.
status = warn
appender.server.type = File
appender.server.name = server
appender.server.fileName = ${sys:kafka.logs.dir}/server.log
appender.server.layout.type = PatternLayout
appender.server.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.server.ref = server
logger.request.name = kafka.request.logger
logger.request.level = WARN
logger.statechange.name = state.change.logger
logger.statechange.level = WARN
logger.authorizer.name = kafka.authorizer.logger
logger.authorizer.level = WARN
EOF
}

fail_start() {
    local dir="$1" why="$2"
    echo "---- tail of $dir/logs/server.log ----" >&2
    tail -n 40 "$dir/logs/server.log" >&2 2>/dev/null || true
    echo "---- tail of $dir/logs/kafkaServer.out ----" >&2
    tail -n 20 "$dir/logs/kafkaServer.out" >&2 2>/dev/null || true
    die "$why"
}

# One attempt: 0 = up, 2 = port lost to another process (retry), else die.
start_once() {
    local dir="$1" ports port cport cluster_id
    ports="$(free_ports 2)"
    port="${ports% *}"
    cport="${ports#* }"
    rm -rf "$dir/kraft-logs" "$dir/logs"
    mkdir -p "$dir/logs"
    write_config "$dir" "$port" "$cport"
    cluster_id="$(random_cluster_id)"
    local jvm_common=(-Djava.awt.headless=true "-Dlog4j2.configurationFile=$dir/log4j2.properties"
        "-Dkafka.logs.dir=$dir/logs" -cp "$LIBS/*")
    if ! java -Xmx256m "${jvm_common[@]}" kafka.tools.StorageTool format \
        -t "$cluster_id" -c "$dir/server.properties" >"$dir/logs/format.out" 2>&1; then
        cat "$dir/logs/format.out" >&2
        die "kafka-storage format failed (cluster id $cluster_id, config $dir/server.properties)"
    fi
    launch "$dir" "$port" "$cport"
}

# Start the broker of DIR (formatted, configured) and wait until it serves PORT.
# 0 = up, 2 = port lost to another process, else die.
launch() {
    local dir="$1" port="$2" cport="$3" pid deadline
    local jvm_common=(-Djava.awt.headless=true "-Dlog4j2.configurationFile=$dir/log4j2.properties"
        "-Dkafka.logs.dir=$dir/logs" -cp "$LIBS/*")
    # shellcheck disable=SC2086  # the heap/JVM option strings are word lists on purpose
    nohup java ${KAFKA_HEAP_OPTS:--Xmx512m -Xms256m} -server -XX:+UseG1GC -XX:MaxGCPauseMillis=20 \
        -XX:InitiatingHeapOccupancyPercent=35 -XX:+ExplicitGCInvokesConcurrent -XX:MaxInlineLevel=15 \
        ${KAFKA_JVM_OPTS:-} "${jvm_common[@]}" kafka.Kafka "$dir/server.properties" \
        </dev/null >"$dir/logs/kafkaServer.out" 2>&1 &
    pid=$!
    echo "$pid" >"$dir/pid"
    deadline=$((SECONDS + ${KAFKA_START_TIMEOUT:-90}))
    while ((SECONDS < deadline)); do
        if ! pid_alive "$pid"; then
            rm -f "$dir/pid"
            if grep -qi 'address already in use' "$dir/logs/server.log" "$dir/logs/kafkaServer.out" 2>/dev/null; then
                return 2
            fi
            fail_start "$dir" "the broker (pid $pid) exited during startup"
        fi
        if port_open "$port" && grep -q 'Kafka Server started' "$dir/logs/server.log" 2>/dev/null; then
            echo "$HOST:$port" >"$dir/bootstrap"
            echo "$HOST:$cport" >"$dir/controller"
            return 0
        fi
        sleep 0.3
    done
    kill -KILL "$pid" 2>/dev/null || true
    rm -f "$dir/pid"
    fail_start "$dir" "the broker did not answer on $HOST:$port within ${KAFKA_START_TIMEOUT:-90}s (killed pid $pid)"
}

cmd_start() {
    local dir="${1:-}"
    [[ -n "$dir" ]] || die "usage: kafka.sh start DATA_DIR"
    need_java
    mkdir -p "$dir"
    dir="$(cd "$dir" && pwd)"
    if [[ -f "$dir/pid" ]] && pid_alive "$(cat "$dir/pid")" && is_our_broker "$(cat "$dir/pid")" "$dir"; then
        die "a broker is already running for $dir (pid $(cat "$dir/pid")); run: kafka.sh stop $dir"
    fi
    cmd_fetch
    local attempt rc
    for attempt in 1 2 3; do
        rc=0
        start_once "$dir" || rc=$?
        [[ $rc -eq 0 ]] && break
        log "port taken by another process while starting (attempt $attempt), retrying on new ports"
    done
    [[ $rc -eq 0 ]] || fail_start "$dir" "could not bind free ports after 3 attempts"
    local ran
    ran="$(sed -n 's/.*Kafka version: \([^ ]*\).*/\1/p' "$dir/logs/server.log" | head -n 1)"
    ran="${ran:-$KAFKA_VERSION}"
    echo "$ran" >"$dir/version"
    echo "bootstrap=$(cat "$dir/bootstrap")"
    echo "version=$ran"
    log "Kafka $ran (KRaft) up on $(cat "$dir/bootstrap"), pid $(cat "$dir/pid"), data in $dir"
}

cmd_stop() {
    local dir="${1:-}" pid deadline
    [[ -n "$dir" ]] || die "usage: kafka.sh stop DATA_DIR"
    [[ -d "$dir" ]] || { log "no such data dir $dir: nothing to stop"; return 0; }
    dir="$(cd "$dir" && pwd)"
    [[ -f "$dir/pid" ]] || { log "no pid file in $dir: nothing to stop"; return 0; }
    pid="$(cat "$dir/pid")"
    if ! pid_alive "$pid" || ! is_our_broker "$pid" "$dir"; then
        log "broker pid $pid is not running"
        rm -f "$dir/pid"
        return 0
    fi
    kill -TERM "$pid" 2>/dev/null || true
    deadline=$((SECONDS + ${KAFKA_STOP_TIMEOUT:-30}))
    while pid_alive "$pid" && ((SECONDS < deadline)); do sleep 0.2; done
    if pid_alive "$pid"; then
        log "broker pid $pid ignored SIGTERM for ${KAFKA_STOP_TIMEOUT:-30}s: SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
        while pid_alive "$pid"; do sleep 0.1; done
    fi
    rm -f "$dir/pid"
    log "broker pid $pid stopped"
}

# Stop the broker (--kill: SIGKILL, a crash) and start it again with its data, on the same ports.
cmd_restart() {
    local dir="${1:-}" how="${2:-}" pid port cport rc=0
    [[ -n "$dir" && -f "$dir/bootstrap" ]] || die "usage: kafka.sh restart DATA_DIR [--kill] (DATA_DIR of a started broker)"
    need_java
    dir="$(cd "$dir" && pwd)"
    if [[ "$how" == --kill ]]; then
        pid="$(cat "$dir/pid" 2>/dev/null || true)"
        if [[ -n "$pid" ]] && pid_alive "$pid" && is_our_broker "$pid" "$dir"; then
            kill -KILL "$pid"
            while pid_alive "$pid"; do sleep 0.05; done
            log "broker pid $pid killed"
        fi
        rm -f "$dir/pid"
    else
        cmd_stop "$dir"
    fi
    sleep "${RESTART_DOWN_S:-0}"
    # A fresh server.log, so that readiness is this run's "Kafka Server started" line.
    [[ -f "$dir/logs/server.log" ]] && mv -f "$dir/logs/server.log" "$dir/logs/server.log.before-restart"
    port="$(cut -d: -f2 <"$dir/bootstrap")"
    cport="$(cut -d: -f2 <"$dir/controller")"
    launch "$dir" "$port" "$cport" || rc=$?
    [[ $rc -eq 0 ]] || fail_start "$dir" "could not start the broker again on port $port (taken meanwhile?)"
    echo "bootstrap=$(cat "$dir/bootstrap")"
    echo "version=$(cat "$dir/version")"
    log "Kafka restarted on $(cat "$dir/bootstrap"), pid $(cat "$dir/pid")"
}

case "${1:-}" in
fetch) cmd_fetch ;;
start) cmd_start "${2:-}" ;;
stop) cmd_stop "${2:-}" ;;
restart) cmd_restart "${2:-}" "${3:-}" ;;
version) echo "$KAFKA_VERSION" ;;
*)
    echo "usage: $0 {fetch|start DATA_DIR|stop DATA_DIR|restart DATA_DIR [--kill]|version}" >&2
    exit 2
    ;;
esac
