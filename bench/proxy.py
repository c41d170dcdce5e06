"""Proxy overhead and weight-update stall, measured in one run.

1. Added latency: the same requests (greedy, fixed output length) sent straight to the
   engine's ``/generate``, through a minimal pass-through proxy (this file served as
   ``python -m bench.proxy`` with ``BENCH_PASSTHROUGH_ENGINE`` set: FastAPI + uvicorn + the
   proxy's engine clients (``shared.http_client``, one lent to each call in flight), forwarding the
   same ``/generate`` body and answer untouched) and through the proxy's ``/v1/chat/completions`` (a training session:
   the chunk is submitted to Kafka before the answer; its ack is awaited only by ``finish``,
   which this part does not call), in alternating order so drift hits all. Reports p50 / p99
   of each, the ratio proxy / direct, and the overhead ratio (proxy - direct) /
   (pass-through - direct): how much more the proxy adds than the hop itself.
   ``--max-tokens 1`` measures one token per call (the demo's replies).
2. Stall: with ``--inflight`` generations running through the proxy, the broadcaster's
   sequence pause -> engine ``/update_weights_from_disk`` -> resume, timed per step.

Usage (starts an engine, a proxy and, unless ``--kafka`` is given, a local Kafka)::

    $(bash deploy/venv.sh --path)/bin/python bench/proxy.py --requests 300 --out /tmp/rein-bench-proxy.json
    $(bash deploy/venv.sh --path)/bin/python bench/proxy.py --max-tokens 1 --rounds 0 --out /tmp/rein-bench-proxy1.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request, Response

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ops.local.credentials import Credentials
from ops.local.ports import free_port
from shared import checkpoint
from shared.bus import ensure_topology
from shared.http_client import HttpClient
from shared.http_server import KEEP_ALIVE_S
from shared.lender import Lender
from shared.names import Topics
from shared.policy import PolicyConfig, init_policy
from shared.settings import KafkaSettings
from shared.tokenizer import TOKENIZER
from tests.support.procs import Proc, start_service

CREDENTIALS = Credentials("bench-admin-token", "bench-runner-token-0123", "bench-session-key-secret-0123", "bench")
ADMIN = CREDENTIALS.admin_token
RUNNER = {"Authorization": f"Bearer {CREDENTIALS.runner_token}"}
"""The runner's credential: every chat call here names its session by X-Session-Id, as rein's runner does."""
WORDS = ["guess", "higher", "lower", "number", "between", "and", "the", "is"]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def start_engine(weights: Path, step_delay: float, logs: Path) -> tuple[Proc, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_service("services.engine", {
        "REIN_PORT": str(port), "REIN_WEIGHTS_DIR": str(weights), "REIN_STEP_DELAY_S": str(step_delay),
        "REIN_LOG_LEVEL": "warning"}, f"{url}/health", timeout_s=120, log_dir=logs)
    return proc, url


def start_proxy(engine: str, kafka: str, logs: Path) -> tuple[Proc, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    tag = uuid.uuid4().hex[:8]
    bench_topics = Topics(chunks=f"bench.chunks.{tag}", events=f"bench.events.{tag}")
    ensure_topology(KafkaSettings(bootstrap_servers=kafka), bench_topics,
                    only=[bench_topics.chunks, bench_topics.events])
    proc = start_service("services.proxy", {
        "REIN_PORT": str(port), "REIN_ENGINE_URLS": json.dumps([engine]), **CREDENTIALS.proxy_env(),
        "REIN_KAFKA__BOOTSTRAP_SERVERS": kafka, "REIN_TOPICS__CHUNKS": f"bench.chunks.{tag}",
        "REIN_TOPICS__EVENTS": f"bench.events.{tag}", "REIN_LOG_LEVEL": "warning"},
        f"{url}/health", timeout_s=120, log_dir=logs)
    return proc, url


PASSTHROUGH_ENGINE = "BENCH_PASSTHROUGH_ENGINE"
PASSTHROUGH_PORT = "BENCH_PASSTHROUGH_PORT"


def serve_passthrough(engine: str, port: int) -> None:
    """The minimal pass-through: ``POST /generate`` forwarded to ``engine`` as is, its answer returned as is."""
    clients = Lender(lambda: HttpClient(engine, {"Content-Type": "application/json"}))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            for client in clients.items:
                await client.aclose()

    app = FastAPI(lifespan=lifespan)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        with clients.use() as client:
            answer = await client.request("POST", "/generate", await request.body())
        return Response(answer.content, status_code=answer.status, media_type="application/json")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                timeout_keep_alive=KEEP_ALIVE_S)


def start_passthrough(engine: str, logs: Path) -> tuple[Proc, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_service("bench.proxy", {PASSTHROUGH_ENGINE: engine, PASSTHROUGH_PORT: str(port)},
                         f"{url}/health", timeout_s=120, log_dir=logs)
    return proc, url


def overhead(engine: str, passthrough: str, proxy: str, n: int, max_tokens: int, warmup: int) -> dict[str, Any]:
    direct_s: list[float] = []
    pass_s: list[float] = []
    proxy_s: list[float] = []
    untracked_s: list[float] = []
    with httpx.Client(timeout=60, headers=RUNNER) as http:
        for i in range(n + warmup):
            content = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(1 + i % 5))
            messages = [{"role": "user", "content": content}]
            ids = TOKENIZER.apply_chat_template(messages, add_generation_prompt=True)
            direct_body = {"input_ids": ids, "return_logprob": True, "rid": f"bench-{uuid.uuid4().hex}",
                           "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0.0,
                                               "ignore_eos": True}}
            chat_body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                         "ignore_eos": True}
            headers = {"X-Session-Id": f"bench-{uuid.uuid4().hex}", "X-Group-Id": f"g-{i}"}
            order = ("direct", "passthrough", "proxy", "untracked")
            for which in order[i % 4:] + order[: i % 4]:
                t0 = time.perf_counter()
                if which == "direct":
                    direct_body["rid"] = f"bench-{uuid.uuid4().hex}"
                    r = http.post(f"{engine}/generate", json=direct_body)
                elif which == "passthrough":
                    direct_body["rid"] = f"bench-{uuid.uuid4().hex}"
                    r = http.post(f"{passthrough}/generate", json=direct_body)
                elif which == "proxy":
                    r = http.post(f"{proxy}/v1/chat/completions", json=chat_body, headers=headers)
                else:  # no X-Group-Id: served, nothing written to Kafka
                    r = http.post(f"{proxy}/v1/chat/completions", json=chat_body,
                                  headers={"X-Session-Id": f"bench-{uuid.uuid4().hex}"})
                elapsed = time.perf_counter() - t0
                r.raise_for_status()
                if i >= warmup:
                    {"direct": direct_s, "passthrough": pass_s, "proxy": proxy_s,
                     "untracked": untracked_s}[which].append(elapsed)
    ratios = [p / d for p, d in zip(proxy_s, direct_s, strict=True)]
    added = [p - d for p, d in zip(proxy_s, direct_s, strict=True)]

    def over(q: float) -> float | None:
        hop = pct(pass_s, q) - pct(direct_s, q)
        return (pct(proxy_s, q) - pct(direct_s, q)) / hop if hop > 0 else None

    return {
        "requests": n, "max_tokens": max_tokens,
        "direct_ms": {"p50": pct(direct_s, 50) * 1e3, "p99": pct(direct_s, 99) * 1e3},
        "passthrough_ms": {"p50": pct(pass_s, 50) * 1e3, "p99": pct(pass_s, 99) * 1e3},
        "overhead_over_passthrough": {"p50": over(50), "p99": over(99)},
        "proxy_ms": {"p50": pct(proxy_s, 50) * 1e3, "p99": pct(proxy_s, 99) * 1e3},
        "added_ms": {"p50": pct(added, 50) * 1e3, "p99": pct(added, 99) * 1e3},
        "proxy_no_kafka_ms": {"p50": pct(untracked_s, 50) * 1e3, "p99": pct(untracked_s, 99) * 1e3},
        "ratio": {"p50": pct(proxy_s, 50) / pct(direct_s, 50), "p99": pct(proxy_s, 99) / pct(direct_s, 99),
                  "median_of_pairs": statistics.median(ratios),
                  "no_kafka_p50": pct(untracked_s, 50) / pct(direct_s, 50),
                  "no_kafka_p99": pct(untracked_s, 99) / pct(direct_s, 99)},
    }


def stall(engine: str, proxy: str, weights: Path, rounds: int, inflight: int) -> dict[str, Any]:
    cfg = PolicyConfig(vocab_size=TOKENIZER.vocab_size)
    admin = {"Authorization": f"Bearer {ADMIN}"}
    rows: list[dict[str, float]] = []
    with httpx.Client(timeout=120) as http:
        for r in range(rounds):
            version = f"bench-v{r + 1}-{uuid.uuid4().hex[:6]}"
            path = weights / f"{version}.pt"
            checkpoint.save(path, init_policy(cfg, r + 1), cfg, version=version, step=r + 1)
            calls: list[threading.Thread] = []
            answers: list[int] = []

            def agent(k: int, r: int = r, answers: list[int] = answers) -> None:
                body = {"model": "m", "messages": [{"role": "user", "content": "guess"}], "max_tokens": 48,
                        "ignore_eos": True}
                hdrs = {"X-Session-Id": f"stall-{uuid.uuid4().hex}", "X-Group-Id": f"sg-{r}-{k}"}
                with httpx.Client(timeout=120, headers=RUNNER) as client:
                    answers.append(client.post(f"{proxy}/v1/chat/completions", json=body, headers=hdrs).status_code)

            for k in range(inflight):
                calls.append(threading.Thread(target=agent, args=(k,)))
                calls[-1].start()
            deadline = time.monotonic() + 30
            while True:  # every generation started (on a loaded machine the first may already be done)
                active = http.get(f"{proxy}/v1/rollout/state", headers=admin).json()["active"]
                if active >= 1 and active + len(answers) >= inflight:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"generations did not start: {active} active, {len(answers)} answered")
                time.sleep(0.005)
            t0 = time.perf_counter()
            paused = http.post(f"{proxy}/v1/rollout/pause", json={"reason": "bench", "timeout_s": 30},
                               headers=admin).json()
            t1 = time.perf_counter()
            upd = http.post(f"{engine}/update_weights_from_disk",
                            json={"model_path": str(path), "weight_version": version})
            upd.raise_for_status()
            t2 = time.perf_counter()
            http.post(f"{proxy}/v1/rollout/resume", json={"version": version}, headers=admin).raise_for_status()
            t3 = time.perf_counter()
            for call in calls:
                call.join(120)
            if not paused["quiesced"] or any(code != 200 for code in answers):
                raise RuntimeError(f"round {r}: pause {paused}, answers {answers}")
            rows.append({"pause_ms": (t1 - t0) * 1e3, "update_ms": (t2 - t1) * 1e3, "resume_ms": (t3 - t2) * 1e3,
                         "stall_ms": (t3 - t0) * 1e3, "preempted": len(paused["preempted"])})
    keys = ("pause_ms", "update_ms", "resume_ms", "stall_ms")
    return {"rounds": rounds, "inflight": inflight,
            "p50": {k: pct([row[k] for row in rows], 50) for k in keys},
            "max": {k: max(row[k] for row in rows) for k in keys},
            "preempted_mean": statistics.mean(row["preempted"] for row in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kafka", help="bootstrap servers of a running broker (default: start a local one)")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per call (1: one token per call)")
    parser.add_argument("--rounds", type=int, default=10, help="pause/update/resume rounds (0: skip the stall part)")
    parser.add_argument("--inflight", type=int, default=8, help="generations in flight during each update")
    parser.add_argument("--stall-step-delay", type=float, default=0.01,
                        help="engine step delay for the stall part, so generations are still running at pause")
    parser.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "rein-bench-proxy.json"))
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="rein-bench-proxy-"))
    procs: list[Proc] = []
    infra = None
    st: dict[str, Any] | None = None
    try:
        kafka = args.kafka
        if kafka is None:
            from tests.support.infra import KAFKA, RunInfra

            infra = RunInfra(work / "infra")
            kafka = infra.require(KAFKA).address
        engine_proc, engine = start_engine(work / "w1", 0.0, work)
        procs.append(engine_proc)
        pass_proc, passthrough = start_passthrough(engine, work)
        procs.append(pass_proc)
        proxy_proc, proxy = start_proxy(engine, kafka, work)
        procs.append(proxy_proc)
        over = overhead(engine, passthrough, proxy, args.requests, args.max_tokens, args.warmup)

        if args.rounds > 0:
            slow_proc, slow_engine = start_engine(work / "w2", args.stall_step_delay, work)
            procs.append(slow_proc)
            proxy2_proc, proxy2 = start_proxy(slow_engine, kafka, work)
            procs.append(proxy2_proc)
            st = stall(slow_engine, proxy2, work / "w2", args.rounds, args.inflight)
    finally:
        for proc in reversed(procs):
            proc.stop()
        if infra is not None:
            infra.stop_all()

    result = {"overhead": over, "stall": st, "args": vars(args)}
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"\nproxy overhead ({over['requests']} sequential requests, {over['max_tokens']} tokens, greedy)")
    print(f"{'':6}{'direct ms':>11}{'pass ms':>10}{'proxy ms':>11}{'added ms':>11}{'ratio':>7}"
          f"{'no-kafka ms':>13}{'ratio':>7}{'overhead/pass':>15}")
    for q in ("p50", "p99"):
        rel = over["overhead_over_passthrough"][q]
        print(f"{q:6}{over['direct_ms'][q]:11.2f}{over['passthrough_ms'][q]:10.2f}{over['proxy_ms'][q]:11.2f}"
              f"{over['added_ms'][q]:11.2f}{over['ratio'][q]:7.2f}{over['proxy_no_kafka_ms'][q]:13.2f}"
              f"{over['ratio']['no_kafka_' + q]:7.2f}{'n/a' if rel is None else f'{rel:.2f}':>15}")
    print("overhead/pass: (proxy - direct) / (pass-through - direct)")
    if st is not None:
        print(f"\npause -> update -> resume ({st['rounds']} rounds, {st['inflight']} generations in flight)")
        print(f"{'':10}{'pause':>10}{'update':>10}{'resume':>10}{'stall':>10}")
        for row in ("p50", "max"):
            print(f"{row:10}" + "".join(f"{st[row][k]:10.1f}" for k in ("pause_ms", "update_ms", "resume_ms",
                                                                          "stall_ms")))
    print(f"\nwritten {args.out}")


if __name__ == "__main__":
    if PASSTHROUGH_ENGINE in os.environ:
        serve_passthrough(os.environ[PASSTHROUGH_ENGINE], int(os.environ[PASSTHROUGH_PORT]))
    else:
        main()
