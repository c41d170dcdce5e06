"""What replicas buy on this machine, side by side in one run: collectors, proxies, trainer ranks.

    $(bash deploy/venv.sh --path)/bin/python bench/scale_out.py --out bench/scale_out.json

Starts a throwaway Kafka and Redis (deploy/kafka.sh, deploy/redis.sh), or uses the ones ``--bootstrap`` and
``--redis-url`` name (every topic, consumer group and key it makes is its own), and measures, in this order:

1. groups/s through 1, 2 and 4 collector replicas (``bench/collector.py``'s measurement: real
   ``python -m services.collector`` processes on one 4-partition stream, groups of 8 x 256 tokens);
2. chat calls/s through 1 proxy, and through 2 proxy replicas behind HAProxy (``deploy/haproxy.sh``,
   session affinity), in front of one tiny CPU engine: ``--concurrency`` agents, each a session of
   ``--turns`` calls continuing its transcript, then a new one, for ``--seconds``;
3. the trainer's step with 1 and 2 torch.distributed ranks (``bench/trainer_ranks.py``, the random tiny
   Llama unless ``--smollm2``), as a subprocess of this run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.collector import start_infra, stop_infra, throughput  # noqa: E402
from bench.proxy import RUNNER, start_engine, start_proxy  # noqa: E402
from ops.local.launcher import deploy_script  # noqa: E402
from tests.support.procs import Proc  # noqa: E402


async def _drive(url: str, concurrency: int, turns: int, seconds: float) -> dict[str, Any]:
    """Calls completed (and failed) by ``concurrency`` agents in ``seconds``."""
    done, failed = 0, 0
    end = time.monotonic() + seconds

    async def agent(client: httpx.AsyncClient) -> None:
        nonlocal done, failed
        while time.monotonic() < end:
            headers = {"X-Session-Id": f"bench-{uuid.uuid4().hex}", "X-Group-Id": "bench"}
            messages: list[dict[str, str]] = [{"role": "user", "content": "guess a number between 1 and 10"}]
            for _ in range(turns):
                if time.monotonic() >= end:
                    break
                answer = await client.post(f"{url}/v1/chat/completions", headers=headers,
                                           json={"messages": messages, "max_tokens": 4, "temperature": 1.0})
                if answer.status_code != 200:
                    failed += 1
                    break
                done += 1
                messages += [answer.json()["choices"][0]["message"], {"role": "user", "content": "again"}]

    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=concurrency),
                                 headers=RUNNER) as client:
        started = time.monotonic()
        await asyncio.gather(*(agent(client) for _ in range(concurrency)))
        elapsed = time.monotonic() - started
    return {"calls": done, "failed": failed, "seconds": round(elapsed, 2), "calls_per_s": round(done / elapsed, 1)}


def proxies(bootstrap: str, work: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    deploy_script("haproxy.sh", "install", timeout_s=900)
    engine_proc: Proc | None = None
    rows = []
    try:
        engine_proc, engine = start_engine(work / "weights", 0.0, work)
        for n in (1, 2):
            started = [start_proxy(engine, bootstrap, work) for _ in range(n)]
            url = started[0][1]
            if n > 1:
                url = deploy_script("haproxy.sh", "start", str(work / f"haproxy-{n}"),
                                    *(u.removeprefix("http://") for _, u in started))["url"]
            try:
                rows.append({"proxies": n, **asyncio.run(_drive(url, args.concurrency, args.turns, args.seconds))})
            finally:
                if n > 1:
                    deploy_script("haproxy.sh", "stop", str(work / f"haproxy-{n}"))
                for proc, _ in started:
                    proc.stop()
    finally:
        if engine_proc is not None:
            engine_proc.stop()
    return rows


def trainer(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    out = work / "trainer_ranks.json"
    model = [] if args.smollm2 else ["--tiny-llama"]
    subprocess.run([sys.executable, str(REPO / "bench" / "trainer_ranks.py"), *model, "--samples",
                    str(args.trainer_samples), "--rounds", str(args.trainer_rounds), *args.trainer_args, "--out",
                    str(out)], check=True, timeout=3600)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bootstrap", help="a running Kafka broker (with --redis-url; default: start both)")
    parser.add_argument("--redis-url", help="a running Redis")
    parser.add_argument("--groups", type=int, default=400, help="groups per collector measurement")
    parser.add_argument("--collectors", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--concurrency", type=int, default=16, help="agents driving the proxies")
    parser.add_argument("--turns", type=int, default=4, help="calls per session")
    parser.add_argument("--seconds", type=float, default=30.0, help="how long each proxy variant is driven")
    parser.add_argument("--smollm2", action="store_true", help="the trainer part on SmolLM2 (slow) instead")
    parser.add_argument("--trainer-samples", type=int, default=8)
    parser.add_argument("--trainer-rounds", type=int, default=3)
    parser.add_argument("--trainer-args", nargs=argparse.REMAINDER, default=[],
                        help="more flags for bench/trainer_ranks.py (last on the line)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="rein-bench-scale-"))
    own = not (args.bootstrap and args.redis_url)
    bootstrap, redis_url = start_infra(work) if own else (args.bootstrap, args.redis_url)
    try:
        collectors = [throughput(bootstrap, redis_url, r, args.groups) for r in args.collectors]
        proxy_rows = proxies(bootstrap, work, args)
    finally:
        if own:
            stop_infra(work)
    ranks = trainer(work, args)

    base = collectors[0]["groups_per_s"]
    print(f"\n{'collectors':>10} {'groups/s':>9} {'x 1':>6}   ({args.groups} groups of 8 x 256 tokens)")
    for r in collectors:
        r["x_one"] = round(r["groups_per_s"] / base, 2)
        print(f"{r['replicas']:>10} {r['groups_per_s']:>9} {r['x_one']:>6}")
    base = proxy_rows[0]["calls_per_s"]
    print(f"\n{'proxies':>10} {'calls/s':>9} {'x 1':>6} {'failed':>7}   ({args.concurrency} agents, {args.turns} calls "
          "per session, one tiny engine)")
    for r in proxy_rows:
        r["x_one"] = round(r["calls_per_s"] / base, 2)
        print(f"{r['proxies']:>10} {r['calls_per_s']:>9} {r['x_one']:>6} {r['failed']:>7}")
    print(f"\n{'trainer':>10} {'step s':>9} {'x 1':>6}   ({ranks['model']})")
    for r in ranks["rows"]:
        print(f"{r['variant']:>10} {r['step_s']:>9.3f} {r['x_one_rank']:>6.2f}")
    args.out.write_text(json.dumps({"collectors": collectors, "proxies": proxy_rows, "trainer": ranks,
                                    "args": {k: v for k, v in vars(args).items() if k != "out"}}, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
