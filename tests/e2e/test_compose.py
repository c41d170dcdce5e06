"""`docker compose up`, for real: the whole system in containers, scaled, killed and resumed.

What a user runs, on the images ``deploy/images.sh`` builds without a registry (the compose file
is unchanged; ``deploy/images/local.env`` swaps the official Kafka, Redis, Prometheus and Python
images for local ones configured the same way). The Docker engine is installed and started if
absent (``deploy/docker.sh``) and stopped again if this test started it; the project is always
taken down with its volumes. One scenario, in order, each step with a bounded wait:

0. ``--profile gpu config``: the GPU profile's configuration is valid (there is no GPU to run it on).
1. ``up -d``: Kafka, Redis, topics, trainer, broadcaster, engine, proxy, collector, runner; the
   trainer steps; ``rein status`` and ``rein tail`` on the host reach the containers.
2. ``up -d --scale proxy=3 --scale engine=2 --scale collector=3``: three members in the collectors'
   consumer group, three proxies and two engines registered (the broadcaster pauses every proxy and
   updates both engines; HAProxy keeps each session on one proxy); training goes on.
3. ``kill trainer`` then ``up -d``: the trainer resumes from its newest durable step and steps on.
4. The observability profile's Prometheus has every rein service's target up.
5. The runner stops; read back from the host: every completed group decided, no group in two
   manifests, every finished session's chunks numbered 0..n-1 (its calls reached one proxy) or, when two
   proxies served it, its trajectory rejected (``conflicting_chunks``), each session's chunks from one
   engine and both engines serving, no version label naming two different weights.

Figures (build time, time to the first step, image sizes) are printed (``-s``) and written to
``compose.json`` in the test's temp dir, for docs/operations.md.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from kafka.admin import KafkaAdminClient
from kafka.errors import NoBrokersAvailable

from ops.local.ports import free_ports
from shared.bus import new_client, read_topic
from shared.schemas import (
    BatchManifest,
    Chunk,
    CompletedGroup,
    DecisionRecord,
    SessionFinished,
    WeightApplied,
    WeightPublished,
)
from shared.settings import KafkaSettings
from tests.support.wait import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.compose, pytest.mark.timeout(3600)]

REPO = Path(__file__).resolve().parents[2]
LOCAL_ENV = REPO / "deploy" / "images" / "local.env"
HA_ENV = REPO / "deploy" / "ha.env"
HA_PARTS = ("kafka-2", "kafka-3", "redis-replica", "redis-replica-2", "sentinel-1", "sentinel-2", "sentinel-3")
"""What the ``ha`` profile adds (``deploy/ha.env``): the test runs the highly available topology."""
REIN_TARGETS = {"engine", "proxy", "trainer", "weight_broadcaster", "collector", "rollout"}
SCALE = ("--scale", "proxy=3", "--scale", "engine=2", "--scale", "collector=3")
"""Prometheus jobs that must be up (``sglang`` is only there with ``--profile gpu``)."""

T = TypeVar("T")


def _wait(what: str, cond: Callable[[], T | None], timeout_s: float, on_fail: Callable[[], str]) -> T:
    """:func:`wait_until` at the pace of containers, with the services' logs when it times out."""
    return wait_until(cond, timeout_s, what, interval_s=2, details=on_fail)  # type: ignore[return-value]


def _run(cmd: list[str], timeout_s: float, env: dict[str, str] | None = None,
         context: Callable[[], str] = lambda: "") -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=REPO)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{' '.join(cmd)} did not finish within {timeout_s:.0f}s\n{context()}")
    if done.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {done.returncode}\n--- stdout\n{done.stdout[-4000:]}\n"
                    f"--- stderr\n{done.stderr[-4000:]}\n{context()}")
    return done.stdout + done.stderr


@dataclass
class Compose:
    """One compose project on the local images, with its host ports."""

    project: str
    ports: dict[str, int]
    secrets: Path
    """The deployment's secrets, as ``deploy/compose-env.sh`` writes them (compose refuses to start without)."""
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        reaper = os.environ.get("PYTEST_REIN_REAPER_DIR")  # removes the project if the run is SIGKILLed
        if reaper:
            with (Path(reaper) / "compose-projects").open("a") as listing:
                listing.write(self.project + "\n")
        _run(["bash", str(REPO / "deploy" / "compose-env.sh"), str(self.secrets)], 30)
        # The containers' brokers get the JVM flags of every broker the tests start (tests/conftest.py: the quick
        # compiler only); with the image's, the three took 65 CPU-s of a run alone, 46 with these.
        self.env = {**os.environ, "LOG_LEVEL": "info",
                    "KAFKA_JVM_PERFORMANCE_OPTS": os.environ.get("KAFKA_JVM_OPTS", ""),
                    **{f"{name.upper()}_HOST_PORT": str(port) for name, port in self.ports.items()}}

    @property
    def admin_token(self) -> str:
        return next(line.split("=", 1)[1] for line in self.secrets.read_text().splitlines()
                    if line.startswith("ADMIN_TOKEN="))

    def _compose(self) -> list[str]:
        return ["docker", "compose", "--env-file", str(self.secrets), "--env-file", str(LOCAL_ENV), "--env-file",
                str(HA_ENV), "-p", self.project]

    def __call__(self, *args: str, timeout_s: float = 600) -> str:
        return _run([*self._compose(), *args], timeout_s, self.env, context=lambda: "--- logs\n" + self.logs(tail=15))

    def logs(self, *services: str, tail: int = 40) -> str:
        """The services' last log lines (all services when none is named)."""
        done = subprocess.run([*self._compose(), "logs", "--no-color", "--tail", str(tail), *services],
                              capture_output=True, text=True, timeout=60, env=self.env, cwd=REPO)
        return done.stdout[-8000:] + done.stderr[-2000:]

    def ps(self) -> list[dict[str, Any]]:
        out = self("ps", "--all", "--format", "json", timeout_s=60)
        return [json.loads(line) for line in out.splitlines() if line.startswith("{")]

    @property
    def kafka(self) -> KafkaSettings:
        return KafkaSettings(bootstrap_servers=f"127.0.0.1:{self.ports['kafka']}")


@pytest.fixture(scope="module")
def figures(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    out: dict[str, Any] = {}
    yield out
    path = tmp_path_factory.mktemp("compose") / "compose.json"
    path.write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    print(f"\ncompose figures ({path}):\n{json.dumps(out, indent=2, sort_keys=True)}", file=sys.stderr)


@pytest.fixture(scope="module")
def docker_engine() -> Iterator[None]:
    """A Docker engine and Compose v2; the engine is stopped afterwards if this fixture started it."""
    _run(["bash", "deploy/docker.sh", "install"], 900)
    ours = subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode != 0
    _run(["bash", "deploy/docker.sh", "start"], 120)
    try:
        yield
    finally:
        if ours:
            _run(["bash", "deploy/docker.sh", "stop"], 120)


@pytest.fixture(scope="module")
def images(docker_engine: None, figures: dict[str, Any]) -> None:
    t0 = time.monotonic()
    _run(["bash", "deploy/images.sh", "build"], 2400)
    figures["images_build_s"] = round(time.monotonic() - t0, 1)
    t0 = time.monotonic()
    _run(["bash", "deploy/images.sh", "build"], 600)
    figures["images_rebuild_s"] = round(time.monotonic() - t0, 1)
    tags = [line.split("=", 1)[1] for line in LOCAL_ENV.read_text().splitlines() if "_IMAGE=" in line]
    for tag in [*tags, "rein:local"]:
        size = _run(["docker", "image", "inspect", "-f", "{{.Size}}", tag], 60).strip()
        figures.setdefault("image_mb", {})[tag] = round(int(size) / 1e6)


@pytest.fixture
def compose(images: None, tmp_path: Path) -> Iterator[Compose]:
    names = ("kafka", "kafka_2", "kafka_3", "redis", "proxy", "prometheus", "grafana")
    project = Compose(f"rein-test-{uuid.uuid4().hex[:8]}", dict(zip(names, free_ports(len(names)), strict=True)),
                      tmp_path / "secrets.env")
    try:
        yield project
    finally:
        project("--profile", "observability", "down", "--volumes", "--remove-orphans", "--timeout", "20",
                timeout_s=300)


def _published(compose: Compose) -> list[WeightPublished]:
    return [r for r in read_topic(compose.kafka, "weights", 20) if isinstance(r, WeightPublished)]


def _max_step(compose: Compose) -> int:
    return max((r.step for r in _published(compose)), default=-1)


def _steps_past(compose: Compose, step: int, timeout_s: float, what: str) -> int:
    return _wait(what, lambda: (s := _max_step(compose)) > step and s, timeout_s,
                 lambda: compose.logs("trainer", "collector", "rollout"))


def _rein(*args: str) -> str:
    rein = shutil.which("rein", path=str(Path(sys.executable).parent)) or "rein"
    return _run([rein, *args], 120)


def _status(compose: Compose) -> dict[str, Any]:
    """``rein status --json`` through the balancer, ok or not (it exits 1 when a part is not ok)."""
    rein = shutil.which("rein", path=str(Path(sys.executable).parent)) or "rein"
    cmd = [rein, "status", "--json", "--kafka", compose.kafka.bootstrap_servers,
           "--redis", f"redis://127.0.0.1:{compose.ports['redis']}/0",
           "--proxy", f"http://127.0.0.1:{compose.ports['proxy']}", "--admin-token", compose.admin_token]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    try:
        report: dict[str, Any] = json.loads(done.stdout)
    except ValueError:
        report = {}
    if done.returncode not in (0, 1) or not report:
        pytest.fail(f"rein status exited {done.returncode} without a report\n--- stdout\n{done.stdout[-4000:]}\n"
                    f"--- stderr\n{done.stderr[-4000:]}")
    return report


def _status_ok(compose: Compose, last: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The report once every part is ok; a proxy busy past the status's 5 s bound (a CI run's, with the
    machine loaded by other tests) is asked again. ``last`` keeps the newest report for the failure."""
    last[:] = [_status(compose)]
    return last[0] if last[0]["ok"] else None


def _sentinel_view(compose: Compose, replicated: bool = True) -> str | None:
    """The primary Sentinel 1 names (``host port``); with ``replicated``, only once it knows a replica of it and
    the two other Sentinels (else None)."""
    def ask(*args: str) -> str:
        done = subprocess.run([*compose._compose(), "exec", "-T", "sentinel-1", "redis-cli", "-p", "26379", *args],
                              capture_output=True, text=True, timeout=30, env=compose.env, cwd=REPO)
        return done.stdout if done.returncode == 0 else ""

    master = ask("sentinel", "master", "rein").split()
    fields = dict(zip(master[::2], master[1::2], strict=False))
    if replicated and (int(fields.get("num-slaves", 0)) < 1 or int(fields.get("num-other-sentinels", 0)) < 2):
        return None
    return " ".join(ask("sentinel", "get-master-addr-by-name", "rein").split()) or None


def _collector_members(compose: Compose) -> int:
    """Members of the collectors' group; -1 while the broker does not answer (busy with the scale-up: one
    CI run's admin client timed out on its API-version probe), so the wait polls again instead of failing."""
    try:
        admin = new_client(lambda: KafkaAdminClient(bootstrap_servers=compose.kafka.bootstrap_servers,
                                                    request_timeout_ms=10_000))
    except NoBrokersAvailable:
        return -1
    try:
        [group] = admin.describe_consumer_groups(["rein-collector"])
        return len(group.members)
    finally:
        admin.close()


def test_the_whole_system_runs_scales_and_resumes_in_containers(compose: Compose, figures: dict[str, Any]) -> None:
    compose("--profile", "gpu", "config", "--quiet", timeout_s=60)  # the GPU profile at least parses (no GPU here)

    # 1. Up: the trainer steps; the host's tools reach the containers.
    t0 = time.monotonic()
    compose("up", "-d", timeout_s=900)
    figures["up_s"] = round(time.monotonic() - t0, 1)
    states = {c["Service"]: c["State"] for c in compose.ps()}
    assert states.get("topics") == "exited" and all(
        states.get(s) == "running" for s in ("kafka", "redis", "balancer", *HA_PARTS, *REIN_TARGETS)), states
    first = _steps_past(compose, 0, 600, "the trainer's first step")
    figures["first_step_s"] = round(time.monotonic() - t0, 1)

    last: list[dict[str, Any]] = []
    status = _wait("rein status ok through the balancer", lambda: _status_ok(compose, last), 120,
                   lambda: json.dumps(last, indent=1)[:4000] + "\n" + compose.logs("proxy", "balancer"))
    assert status["registry"] and status["proxies"], json.dumps(status, indent=1)[:4000]
    assert len(status["registered_proxies"]) == 1, status["registered_proxies"]
    assert len(status["registered_engines"]) == 1, status["registered_engines"]
    tailed = _rein("tail", "weights", "--bootstrap", compose.kafka.bootstrap_servers, "--from-beginning", "--max", "1")
    assert "weight_published" in tailed, tailed

    # 2. Three collectors share the partitions, three proxies the sessions, two engines the generations.
    compose("up", "-d", *SCALE)
    _wait("three members in the collectors' group", lambda: _collector_members(compose) == 3, 180,
          lambda: compose.logs("collector"))
    _wait("three proxies and two engines registered", lambda: (
        (s := _status(compose)) and len(s["registered_proxies"]) == 3 and len(s["registered_engines"]) == 2), 180,
          lambda: compose.logs("proxy", "engine", "balancer"))
    scaled = _steps_past(compose, max(first, _max_step(compose)), 600, "a step after scaling")
    _wait("a version applied on both engines", lambda: any(
        isinstance(r, WeightApplied) and len(r.engines) == 2 for r in read_topic(compose.kafka, "weights", 20)),
          300, lambda: compose.logs("weight_broadcaster", "engine"))

    # 3. The trainer is killed and comes back from its newest durable step.
    compose("kill", "trainer", timeout_s=120)
    before = _max_step(compose)
    compose("up", "-d", *SCALE)
    resumed = _wait("the trainer's resume line", lambda: re.search(
        r'"event": "trainer_resumed".*?"step": (\d+)|"step": (\d+).*?"event": "trainer_resumed"',
        compose.logs("trainer", tail=400)), 300, lambda: compose.logs("trainer"))
    assert int(resumed.group(1) or resumed.group(2)) >= before >= scaled, (resumed.group(0), before)
    restarted = _steps_past(compose, before, 600, "a step after the trainer's restart")

    # 3b. A Kafka node and the Redis primary die (SIGKILL) and stay down: the Sentinels promote the replica,
    # the partitions' leaders move to the other nodes, and training goes on.
    primary = _wait("the Sentinels watching the primary and its replica", lambda: _sentinel_view(compose), 120,
                    lambda: compose.logs("sentinel-1", "redis-replica"))
    t0 = time.monotonic()
    compose("kill", "kafka-2", "redis", timeout_s=120)
    _wait("a replica promoted", lambda: (view := _sentinel_view(compose, replicated=False)) and view != primary, 120,
          lambda: compose.logs("sentinel-1", "sentinel-2", "redis-replica"))
    figures["redis_failover_s"] = round(time.monotonic() - t0, 1)
    _steps_past(compose, max(restarted, _max_step(compose)), 600, "a step with a Kafka node and the Redis primary dead")
    figures["step_after_failover_s"] = round(time.monotonic() - t0, 1)

    # 4. Prometheus scrapes every rein service.
    compose("--profile", "observability", "up", "-d", "--no-deps", "prometheus")

    def targets_up() -> set[str] | None:
        try:
            active = httpx.get(f"http://127.0.0.1:{compose.ports['prometheus']}/api/v1/targets", timeout=5).json()
        except (httpx.HTTPError, ValueError):
            return None
        up = {t["labels"]["job"] for t in active["data"]["activeTargets"] if t["health"] == "up"}
        return up if up >= REIN_TARGETS else None

    _wait("every rein target up in Prometheus", targets_up, 180, lambda: compose.logs("prometheus"))

    # 5. Read back: nothing lost, nothing trained twice, no label for two different weights.
    compose("stop", "rollout", timeout_s=120)

    def all_decided() -> tuple[list[CompletedGroup], list[DecisionRecord]] | None:
        groups = [r for r in read_topic(compose.kafka, "rollout.groups", 30) if isinstance(r, CompletedGroup)]
        decisions = [r for r in read_topic(compose.kafka, "staleness.decisions", 30) if isinstance(r, DecisionRecord)]
        decided = {d.group_id for d in decisions}
        return (groups, decisions) if groups and all(g.group_id in decided for g in groups) else None

    completed, decisions = _wait("a decision for every completed group", all_decided, 180,
                                 lambda: compose.logs("collector"))
    groups = {g.group_id for g in completed}
    manifests = [r for r in read_topic(compose.kafka, "train.batches", 30) if isinstance(r, BatchManifest)]
    in_manifests = Counter(ref.group_id for m in manifests for ref in m.groups)
    assert not [g for g, n in in_manifests.items() if n > 1], "a group in two manifests"
    assert set(in_manifests) <= groups
    # HAProxy keeps a session on one proxy. The exception: calls that straddle a new replica's start (HAProxy
    # counts a replica up as soon as DNS names it) can be served by both; the collector then rejects that
    # session (two different chunks with one seq) instead of training a stitched trajectory.
    seqs: dict[str, list[int]] = {}
    engines: dict[str, set[str]] = {}
    for chunk in read_topic(compose.kafka, "rollout.chunks", 30):
        if isinstance(chunk, Chunk):
            seqs.setdefault(chunk.session_id, []).append(chunk.seq)
            engines.setdefault(chunk.session_id, set()).add(chunk.engine)
    finished = {r.session_id: r.num_chunks for r in read_topic(compose.kafka, "rollout.events", 30)
                if isinstance(r, SessionFinished)}
    served_twice = {s for s, v in seqs.items() if len(v) != len(set(v))}
    split = [s for s, n in finished.items() if s not in served_twice and sorted(seqs.get(s, [])) != list(range(n))]
    assert finished and not split, f"sessions with chunks missing: {split[:5]}"
    trajectories = {t.session_id: t for g in completed for t in g.trajectories}
    stitched = [s for s in served_twice if s in trajectories and trajectories[s].error != "conflicting_chunks"]
    assert not stitched, f"sessions served by two proxies trained as one: {stitched[:5]}"
    figures["sessions_served_twice"] = len(served_twice)
    moved = [s for s, e in engines.items() if len(e) > 1 and s not in served_twice]
    assert not moved, f"sessions whose chunks came from two engines: {moved[:5]}"
    per_engine = Counter(next(iter(e)) for e in engines.values() if len(e) == 1)
    assert len(per_engine) >= 2, f"both engine replicas served sessions: {per_engine}"
    figures["sessions_per_engine"] = sorted(per_engine.values())
    digests: dict[str, set[str]] = {}
    for record in _published(compose):
        digests.setdefault(record.version, set()).add(record.digest)
    assert all(len(d) == 1 for d in digests.values()), digests
    figures.update(groups=len(groups), decisions=len(decisions), manifests=len(manifests),
                   steps=_max_step(compose), collectors=3, proxies=3, engines=2)
