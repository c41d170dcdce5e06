"""Collector benchmarks: throughput of one and two replicas, and the cost of one window decision.

    python bench/collector.py [--bootstrap HOST:PORT --redis-url URL] [--groups 400] [--json out.json]

Without --bootstrap/--redis-url it starts a throwaway Kafka and Redis through deploy/kafka.sh and
deploy/redis.sh (and stops them). Measures:

1. groups/s through replicas run as real subprocesses (``python -m services.collector``), 1 and 2
   replicas on the same 4-partition stream, groups of 8 trajectories x 256 tokens; the clock runs
   from the first record produced until Redis holds a decision for every group;
2. one window decision (``WindowStore.step``: the atomic Redis transaction) with 10 and with
   100,000 registered versions, and the pure ``window_step`` with an in-memory registry of each size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import redis  # noqa: E402

from ops.local.ports import free_port  # noqa: E402
from services.collector.synthetic import group_records  # noqa: E402
from services.collector.window_store import WindowStore  # noqa: E402
from shared.bus import Producer, ensure_topology  # noqa: E402
from shared.names import RedisKeys, Topics  # noqa: E402
from shared.schemas import Chunk, GroupRef, WeightPublished  # noqa: E402
from shared.settings import KafkaSettings  # noqa: E402
from shared.staleness import WindowGroup, WindowSettings  # noqa: E402
from shared.versions import VersionRegistry  # noqa: E402
from shared.window_rule import WindowReplay  # noqa: E402

TRAJECTORIES = 8
CHUNKS_PER_TRAJ = 2
CONTEXT_PER_CHUNK = 16
OUTPUT_PER_CHUNK = 112  # 2 x (16 + 112) = 256 tokens per trajectory


def start_infra(tmp: Path) -> tuple[str, str]:
    out = {}
    for name in ("kafka", "redis"):
        text = subprocess.run(
            [str(REPO / "deploy" / f"{name}.sh"), "start", str(tmp / name)],
            check=True,
            capture_output=True,
            text=True,
            timeout=900,
        ).stdout
        out[name] = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    return out["kafka"]["bootstrap"], out["redis"]["url"]


def stop_infra(tmp: Path) -> None:
    for name in ("kafka", "redis"):
        subprocess.run([str(REPO / "deploy" / f"{name}.sh"), "stop", str(tmp / name)], timeout=120, check=False)


def wait_health(port: int, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"collector exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError("collector did not become healthy")


def throughput(bootstrap: str, redis_url: str, replicas: int, groups: int) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:8]
    topics = Topics(**{name: f"bench.{tag}.{name}" for name in Topics.model_fields})
    kafka = KafkaSettings(bootstrap_servers=bootstrap)
    ensure_topology(kafka, topics, 4)
    prefix = f"bench-{tag}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("REIN_")}
    env.update(
        {
            "REIN_KAFKA__BOOTSTRAP_SERVERS": bootstrap,
            "REIN_REDIS__URL": redis_url,
            "REIN_REDIS__KEY_PREFIX": prefix,
            "REIN_CONSUMER_GROUP": f"bench-{tag}",
            "REIN_KEEP_VERSIONS": "2",
            "REIN_BATCH_GROUPS": "32",
            "REIN_LOG_LEVEL": "warning",
            "REIN_POLL_TIMEOUT_S": "0.05",
            **{f"REIN_TOPICS__{name.upper()}": getattr(topics, name) for name in Topics.model_fields},
        }
    )
    procs = []
    try:
        for i in range(replicas):
            port = free_port()
            proc = subprocess.Popen(
                [sys.executable, "-m", "services.collector"],
                cwd=REPO,
                env=env | {"REIN_METRICS_PORT": str(port), "REIN_REPLICA_ID": f"bench-{i}"},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            procs.append(proc)
            wait_health(port, proc)
        time.sleep(2.0)  # let the consumer group settle after the last member joined (no event exposes it)
        producer = Producer(kafka)
        producer.send(topics.weights, WeightPublished(version="v1", seq=1, path="-", digest="-", step=1))
        client = redis.Redis.from_url(redis_url)
        decided = RedisKeys(prefix).decided
        start = time.perf_counter()
        futures = []
        for g in range(groups):
            for record in group_records(
                f"g{g:06d}",
                [["v1"] * CHUNKS_PER_TRAJ] * TRAJECTORIES,
                tokens_per_chunk=OUTPUT_PER_CHUNK,
                context_per_chunk=CONTEXT_PER_CHUNK,
                rewards=[float(i % 2) for i in range(TRAJECTORIES)],  # signal: groups are kept and batched
            ):
                futures.append(
                    producer.send_async(topics.chunks if isinstance(record, Chunk) else topics.events, record)
                )
        for f in futures:
            producer.wait(f)
        produced = time.perf_counter() - start
        deadline = time.monotonic() + 600
        while client.hlen(decided) < groups:
            if time.monotonic() > deadline:
                raise TimeoutError("not every group was decided")
            time.sleep(0.02)
        elapsed = time.perf_counter() - start
        producer.close()
        client.close()
    finally:
        for proc in procs:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
    return {
        "replicas": replicas,
        "groups": groups,
        "seconds": round(elapsed, 3),
        "groups_per_s": round(groups / elapsed, 1),
        "produce_seconds": round(produced, 3),
        "tokens_per_group": TRAJECTORIES * CHUNKS_PER_TRAJ * (CONTEXT_PER_CHUNK + OUTPUT_PER_CHUNK),
    }


def fill_registry(client: redis.Redis, keys: RedisKeys, n: int) -> None:
    """n published versions v0..v{n-1}, written as the registry's publish script would."""
    step = 10_000
    for lo in range(0, n, step):
        pipe = client.pipeline(transaction=False)
        hi = min(n, lo + step)
        pipe.hset(keys.registry, mapping={f"v{i}": i for i in range(lo, hi)})
        pipe.zadd(keys.registry_order, {f"v{i}": i for i in range(lo, hi)})
        pipe.execute()


def decision_cost(redis_url: str, versions: int, steps: int) -> dict[str, Any]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    keys = RedisKeys(f"bench-dec-{uuid.uuid4().hex[:8]}")
    fill_registry(client, keys, versions)
    store = WindowStore(client, keys, Topics(), WindowSettings(keep_versions=2, batch_groups=32), replica="bench")
    store.claim_config()
    newest = versions - 1
    timings = []
    for i in range(steps):
        label = f"v{newest - (i % 2)}"
        group = WindowGroup(f"g{i}", "p", 0, False, (label,) * TRAJECTORIES)
        t0 = time.perf_counter()
        store.step(group, GroupRef(group_id=group.group_id, partition=0, offset=i))
        timings.append(time.perf_counter() - t0)
        if i % 64 == 63:
            client.delete(keys.outbox)
    # pure fold with the in-memory registry of the same size
    registry = VersionRegistry()
    for i in range(versions):
        registry.publish(f"v{i}", i)
    fold = WindowReplay(WindowSettings(keep_versions=2, batch_groups=32), registry.index)
    pure = []
    for i in range(steps):
        group = WindowGroup(f"g{i}", "p", 0, False, (f"v{newest - (i % 2)}",) * TRAJECTORIES)
        t0 = time.perf_counter()
        fold.feed(group)
        pure.append(time.perf_counter() - t0)
    for key in (
        keys.registry,
        keys.registry_order,
        keys.window,
        keys.pending,
        keys.pending_order,
        keys.decided,
        keys.decided_at,
        keys.outbox,
    ):
        client.delete(key)
    client.close()
    us = sorted(t * 1e6 for t in timings)
    return {
        "registered_versions": versions,
        "steps": steps,
        "redis_step_us_p50": round(statistics.median(us), 1),
        "redis_step_us_p99": round(us[int(len(us) * 0.99) - 1], 1),
        "pure_step_us_p50": round(statistics.median(t * 1e6 for t in pure), 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bootstrap")
    parser.add_argument("--redis-url")
    parser.add_argument("--groups", type=int, default=400)
    parser.add_argument("--steps", type=int, default=500, help="window decisions timed per registry size")
    parser.add_argument("--versions", type=int, nargs="+", default=[10, 100_000], help="registry sizes")
    parser.add_argument("--json", type=Path, default=REPO / "bench" / "collector.json")
    args = parser.parse_args()
    tmp = None
    if not (args.bootstrap and args.redis_url):
        tmp = Path(tempfile.mkdtemp(prefix="rein-bench-"))
        args.bootstrap, args.redis_url = start_infra(tmp)
    try:
        decisions = [decision_cost(args.redis_url, n, args.steps) for n in args.versions]
        runs = [throughput(args.bootstrap, args.redis_url, r, args.groups) for r in (1, 2)]
    finally:
        if tmp is not None:
            stop_infra(tmp)
    print(f"{'replicas':>8} {'groups':>7} {'seconds':>8} {'groups/s':>9}   (8 trajectories x 256 tokens per group)")
    for r in runs:
        print(f"{r['replicas']:>8} {r['groups']:>7} {r['seconds']:>8} {r['groups_per_s']:>9}")
    print()
    print(f"{'versions':>9} {'redis step p50 us':>18} {'p99 us':>9} {'pure step p50 us':>17}")
    for d in decisions:
        print(
            f"{d['registered_versions']:>9} {d['redis_step_us_p50']:>18} {d['redis_step_us_p99']:>9} "
            f"{d['pure_step_us_p50']:>17}"
        )
    args.json.write_text(json.dumps({"throughput": runs, "decision_cost": decisions}, indent=2) + "\n")
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
