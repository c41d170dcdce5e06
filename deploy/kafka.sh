#!/usr/bin/env bash
# A real Apache Kafka (KRaft, combined broker + controller per node) without Docker: one node, or a cluster.
#
#   deploy/kafka.sh fetch            resolve the broker jars from Maven Central into the cache
#   deploy/kafka.sh start DATA_DIR [--brokers N]
#                                    format a fresh KRaft log and start a broker on free ports; with N > 1,
#                                    N nodes in DATA_DIR/broker-1..N forming one quorum, topics created with
#                                    the brokers' defaults: replication min(N, 3), min.insync.replicas 2 from 3
#   deploy/kafka.sh stop DATA_DIR    stop the broker(s) started in DATA_DIR (TERM, bounded wait, then KILL)
#   deploy/kafka.sh restart DATA_DIR [--kill]
#                                    stop it (--kill: SIGKILL, a crash) and start it again with its data
#                                    on the same ports (the fault tests use this); RESTART_DOWN_S=N
#                                    in the environment leaves it down N seconds in between; in a cluster,
#                                    DATA_DIR is one node's (DATA_DIR/broker-2)
#   deploy/kafka.sh kill DATA_DIR    SIGKILL the broker of DATA_DIR (one node's in a cluster) and leave it down
#   deploy/kafka.sh version          print the Kafka version deploy/kafka/pom.xml pins
#
# The jars live outside the checkout, in ${REIN_CACHE:-$HOME/.cache/rein}/kafka-<version>/libs,
# with a .complete marker so an interrupted download is redone. Maven keeps its own ~/.m2 cache.
#
# After `start`, DATA_DIR holds: server.properties, log4j2.properties, pid, bootstrap (host:port),
# controller (host:port), version, logs/server.log, logs/kafkaServer.out and the KRaft log dirs; a
# cluster's DATA_DIR holds brokers (N), bootstrap (every node, comma-separated) and version, and each
# broker-I directory what one node's DATA_DIR holds.
# `start` prints two lines: `bootstrap=HOST:PORT[,HOST:PORT...]` and `version=X.Y.Z` (as the broker logged).
#
# Class data sharing: the first broker that stops cleanly leaves the classes it loaded in an archive in
# the jars' cache (one per Java install), and every later JVM of this script maps it instead of loading
# and verifying them again: a broker's start took 2.0 s of CPU instead of 3.4 here (docs/development.md).
#
# Knobs (environment, all optional): REIN_CACHE, KAFKA_HEAP_OPTS (default -Xmx512m -Xms256m),
# KAFKA_JVM_OPTS (extra JVM flags, of the brokers and the storage format), KAFKA_START_TIMEOUT (seconds, default 90),
# KAFKA_STOP_TIMEOUT (seconds, default 30).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
POM="$HERE/kafka/pom.xml"
CACHE="${REIN_CACHE:-$HOME/.cache/rein}"
HOST=127.0.0.1
# shellcheck source=deploy/common.sh
source "$HERE/common.sh"

kafka_version() {
    local v
    v="$(sed -n 's:.*<kafka.version>\([^<]*\)</kafka.version>.*:\1:p' "$POM" | head -n 1)"
    [[ -n "$v" ]] || die "cannot read <kafka.version> from $POM"
    echo "$v"
}

KAFKA_VERSION="$(kafka_version)"
KAFKA_HOME="$CACHE/kafka-$KAFKA_VERSION"
LIBS="$KAFKA_HOME/libs"

# The class archive of this Kafka and this Java install, by the java binary's path and modification time (Java
# ignores an archive that does not match it, so an upgraded Java in place would never get a fresh one).
cds_archive() {
    local java
    java="$(readlink -f "$(command -v java)")"
    echo "$KAFKA_HOME/classes-$(printf '%s %s' "$java" "$(stat -c %Y "$java")" | cksum | cut -d' ' -f1).jsa"
}

# CDS_FLAGS: the JVM flags for class data sharing: map the archive, or (none yet) have the broker of
# DIR (when given) write one into DIR as it exits; `stop` moves it into the cache whole.
cds_flags() {
    local archive
    archive="$(cds_archive)"
    CDS_FLAGS=()
    if [[ -s "$archive" ]]; then
        CDS_FLAGS=("-XX:SharedArchiveFile=$archive")
    elif [[ -n "${1:-}" ]]; then
        CDS_FLAGS=("-XX:ArchiveClassesAtExit=$1/classes.jsa")
    fi
}

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

# True when PID is a kafka.Kafka JVM started for DATA_DIR (guards against a recycled pid).
is_our_broker() {
    local pid="$1" dir="$2"
    [[ -r "/proc/$pid/cmdline" ]] || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q "kafka.Kafka $dir/server.properties"
}

# write_config DIR PORT CPORT NODE_ID VOTERS NODES
write_config() {
    local dir="$1" port="$2" cport="$3" node="$4" voters="$5" nodes="$6" rf isr
    rf=$((nodes < 3 ? nodes : 3))
    isr=$((rf < 3 ? 1 : 2))
    cat >"$dir/server.properties" <<EOF
# Written by deploy/kafka.sh: KRaft, broker and controller in one JVM, node $node of $nodes.
process.roles=broker,controller
node.id=$node
controller.quorum.voters=$voters
listeners=PLAINTEXT://$HOST:$port,CONTROLLER://$HOST:$cport
advertised.listeners=PLAINTEXT://$HOST:$port
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
log.dirs=$dir/kraft-logs
num.partitions=4
default.replication.factor=$rf
min.insync.replicas=$isr
auto.create.topics.enable=false
delete.topic.enable=true
offsets.topic.replication.factor=$rf
offsets.topic.num.partitions=8
transaction.state.log.replication.factor=$rf
transaction.state.log.min.isr=$isr
transaction.state.log.num.partitions=4
share.coordinator.state.topic.replication.factor=$rf
share.coordinator.state.topic.min.isr=$isr
group.initial.rebalance.delay.ms=0
num.network.threads=2
num.io.threads=4
num.recovery.threads.per.data.dir=1
log.retention.hours=168
# The active controller's no-op record when the metadata log is quiet (a health signal, KIP-835): every 5 s
# instead of every 0.5 s. An idle broker used 15 ms of CPU a second with the default, 10 with this.
metadata.max.idle.interval.ms=5000
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

# The directory of node I of a start in DIR with N nodes (one node: DIR itself).
node_dir() { if (($3 == 1)); then echo "$1"; else echo "$1/broker-$2"; fi; }

# One attempt with N nodes: 0 = up, 2 = port lost to another process (retry), else die.
start_once() {
    local dir="$1" nodes="$2" ports cluster_id voters="" i rc node
    read -r -a ports <<<"$(free_ports $((2 * nodes)))"
    for ((i = 1; i <= nodes; i++)); do voters+="${voters:+,}$i@$HOST:${ports[2 * i - 1]}"; done
    cluster_id="$(random_cluster_id)"
    for ((i = 1; i <= nodes; i++)); do
        node="$(node_dir "$dir" "$i" "$nodes")"
        rm -rf "$node/kraft-logs" "$node/logs"
        mkdir -p "$node/logs"
        write_config "$node" "${ports[2 * i - 2]}" "${ports[2 * i - 1]}" "$i" "$voters" "$nodes"
        local jvm_common=(-Djava.awt.headless=true "-Dlog4j2.configurationFile=$node/log4j2.properties"
            "-Dkafka.logs.dir=$node/logs" -cp "$LIBS/*")
        cds_flags
        # shellcheck disable=SC2086  # the JVM option string is a word list on purpose
        if ! java -Xmx256m "${CDS_FLAGS[@]}" ${KAFKA_JVM_OPTS:-} "${jvm_common[@]}" kafka.tools.StorageTool format \
            -t "$cluster_id" -c "$node/server.properties" >"$node/logs/format.out" 2>&1; then
            cat "$node/logs/format.out" >&2
            die "kafka-storage format failed (cluster id $cluster_id, config $node/server.properties)"
        fi
    done
    # Every node first: a node is up only once a quorum of controllers has formed.
    for ((i = 1; i <= nodes; i++)); do spawn "$(node_dir "$dir" "$i" "$nodes")"; done
    for ((i = 1; i <= nodes; i++)); do
        rc=0
        await_up "$(node_dir "$dir" "$i" "$nodes")" "${ports[2 * i - 2]}" "${ports[2 * i - 1]}" || rc=$?
        if ((rc != 0)); then
            for ((i = 1; i <= nodes; i++)); do cmd_kill "$(node_dir "$dir" "$i" "$nodes")" 2>/dev/null; done
            return "$rc"
        fi
    done
}

# Start the broker of DIR (formatted, configured) and wait until it serves PORT.
# 0 = up, 2 = port lost to another process, else die.
launch() {
    spawn "$1"
    await_up "$@"
}

# Start the broker of DIR in the background (its pid in DIR/pid).
spawn() {
    local dir="$1"
    local jvm_common=(-Djava.awt.headless=true "-Dlog4j2.configurationFile=$dir/log4j2.properties"
        "-Dkafka.logs.dir=$dir/logs" -cp "$LIBS/*")
    cds_flags "$dir"
    # shellcheck disable=SC2086  # the heap/JVM option strings are word lists on purpose
    nohup java ${KAFKA_HEAP_OPTS:--Xmx512m -Xms256m} -server -XX:+UseG1GC -XX:MaxGCPauseMillis=20 \
        -XX:InitiatingHeapOccupancyPercent=35 -XX:+ExplicitGCInvokesConcurrent -XX:MaxInlineLevel=15 \
        "${CDS_FLAGS[@]}" ${KAFKA_JVM_OPTS:-} "${jvm_common[@]}" kafka.Kafka "$dir/server.properties" \
        </dev/null >"$dir/logs/kafkaServer.out" 2>&1 &
    echo $! >"$dir/pid"
}

# Wait until the broker of DIR serves PORT. 0 = up, 2 = port lost to another process, else die.
await_up() {
    local dir="$1" port="$2" cport="$3" pid deadline
    pid="$(cat "$dir/pid")"
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
    local dir="${1:-}" nodes=1
    [[ -n "$dir" ]] || die "usage: kafka.sh start DATA_DIR [--brokers N]"
    if [[ "${2:-}" == --brokers ]]; then
        nodes="${3:-}"
        [[ "$nodes" =~ ^[1-9][0-9]?$ ]] || die "--brokers takes a node count (1-99), got '${3:-}'"
    elif [[ -n "${2:-}" ]]; then
        die "usage: kafka.sh start DATA_DIR [--brokers N]"
    fi
    need_java
    mkdir -p "$dir"
    dir="$(cd "$dir" && pwd)"
    local first
    first="$(node_dir "$dir" 1 "$nodes")"
    if [[ -f "$first/pid" ]] && pid_alive "$(cat "$first/pid")" && is_our_broker "$(cat "$first/pid")" "$first"; then
        die "a broker is already running for $dir (pid $(cat "$first/pid")); run: kafka.sh stop $dir"
    fi
    cmd_fetch
    local attempt rc i
    for attempt in 1 2 3; do
        rc=0
        start_once "$dir" "$nodes" || rc=$?
        [[ $rc -eq 0 ]] && break
        log "port taken by another process while starting (attempt $attempt), retrying on new ports"
    done
    [[ $rc -eq 0 ]] || fail_start "$first" "could not bind free ports after 3 attempts"
    local ran
    ran="$(sed -n 's/.*Kafka version: \([^ ]*\).*/\1/p' "$first/logs/server.log" | head -n 1)"
    ran="${ran:-$KAFKA_VERSION}"
    if ((nodes > 1)); then
        for ((i = 1; i <= nodes; i++)); do echo "$ran" >"$dir/broker-$i/version"; done
        for ((i = 1; i <= nodes; i++)); do cat "$dir/broker-$i/bootstrap"; done | paste -sd, >"$dir/bootstrap"
        echo "$nodes" >"$dir/brokers"
    fi
    echo "$ran" >"$dir/version"
    echo "bootstrap=$(cat "$dir/bootstrap")"
    echo "version=$ran"
    log "Kafka $ran (KRaft, $nodes node(s)) up on $(cat "$dir/bootstrap"), data in $dir"
}

cmd_kill() {
    local dir="${1:-}"
    [[ -n "$dir" && -d "$dir" ]] || die "usage: kafka.sh kill DATA_DIR (one broker's directory)"
    dir="$(cd "$dir" && pwd)"
    kill_pidfile "$dir/pid" broker is_our_broker "$dir"
}

cmd_stop() {
    local dir="${1:-}" i
    [[ -n "$dir" ]] || die "usage: kafka.sh stop DATA_DIR"
    [[ -d "$dir" ]] || { log "no such data dir $dir: nothing to stop"; return 0; }
    dir="$(cd "$dir" && pwd)"
    if [[ -f "$dir/brokers" ]]; then
        # All at once: a node stopping alone waits on a controller quorum the others already left.
        for ((i = 1; i <= $(cat "$dir/brokers"); i++)); do cmd_stop "$dir/broker-$i" & done
        wait
        return 0
    fi
    [[ -f "$dir/pid" ]] || { log "no pid file in $dir: nothing to stop"; return 0; }
    stop_pidfile "$dir/pid" broker "${KAFKA_STOP_TIMEOUT:-30}" is_our_broker "$dir"
    keep_class_archive "$dir"
}

# A class archive the broker of DIR wrote as it exited becomes the cache's (renamed in: never read half written).
keep_class_archive() {
    local dir="$1" archive old
    archive="$(cds_archive)"
    if [[ -s "$dir/classes.jsa" && ! -s "$archive" ]]; then
        cp "$dir/classes.jsa" "$archive.$$.tmp" && mv -f "$archive.$$.tmp" "$archive" &&
            log "class archive for later brokers: $archive"
        for old in "$KAFKA_HOME"/classes-*.jsa; do  # those of a Java no longer installed
            [[ "$old" == "$archive" ]] || rm -f "$old"
        done
    fi
    rm -f "$dir/classes.jsa"
}

# Stop the broker (--kill: SIGKILL, a crash) and start it again with its data, on the same ports.
cmd_restart() {
    local dir="${1:-}" how="${2:-}" pid port cport rc=0
    [[ -n "$dir" && -f "$dir/bootstrap" ]] || die "usage: kafka.sh restart DATA_DIR [--kill] (DATA_DIR of a started broker)"
    need_java
    dir="$(cd "$dir" && pwd)"
    if [[ "$how" == --kill ]]; then
        cmd_kill "$dir"
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
start) cmd_start "${2:-}" "${3:-}" "${4:-}" ;;
stop) cmd_stop "${2:-}" ;;
restart) cmd_restart "${2:-}" "${3:-}" ;;
kill) cmd_kill "${2:-}" ;;
version) echo "$KAFKA_VERSION" ;;
*)
    echo "usage: $0 {fetch|start DATA_DIR [--brokers N]|stop DATA_DIR|restart DATA_DIR [--kill]|kill DATA_DIR|version}" >&2
    exit 2
    ;;
esac
