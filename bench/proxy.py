"""Proxy overhead and weight-update stall, measured in one run.

1. Added latency: the same requests (greedy, fixed output length) sent straight to the
   engine's ``/generate`` and through the proxy's ``/v1/chat/completions`` (a training
   session: the chunk is written to Kafka and acked before the answer), alternating
   direct / proxy so drift hits both. Reports p50 / p99 of each and of the ratio
   proxy / direct.
2. Stall: with ``--inflight`` generations running through the proxy, the broadcaster's
   sequence pause -> engine ``/update_weights_from_disk`` -> resume, timed per step.

Usage (starts an engine, a proxy and, unless ``--kafka`` is given, a local Kafka)::

    ~/.cache/rein/warm/bin/python bench/proxy.py --requests 300 --out /tmp/rein-bench-proxy.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ops.local.ports import free_port
from shared import checkpoint
from shared.bus import ensure_topology
from shared.names import Topics
from shared.policy import PolicyConfig, init_policy
from shared.settings import KafkaSettings
from shared.tokenizer import TOKENIZER
from tests.support.procs import Proc, start_service

ADMIN = "bench-admin-token"
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
        "REIN_PORT": str(port), "REIN_ENGINE_URLS": json.dumps([engine]), "REIN_ADMIN_TOKEN": ADMIN,
        "REIN_KAFKA__BOOTSTRAP_SERVERS": kafka, "REIN_TOPICS__CHUNKS": f"bench.chunks.{tag}",
        "REIN_TOPICS__EVENTS": f"bench.events.{tag}", "REIN_LOG_LEVEL": "warning"},
        f"{url}/health", timeout_s=120, log_dir=logs)
    return proc, url


def overhead(engine: str, proxy: str, n: int, max_tokens: int, warmup: int) -> dict[str, Any]:
    direct_s: list[float] = []
    proxy_s: list[float] = []
    untracked_s: list[float] = []
    with httpx.Client(timeout=60) as http:
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
            order = ("direct", "proxy", "untracked") if i % 2 == 0 else ("untracked", "proxy", "direct")
            for which in order:
                t0 = time.perf_counter()
                if which == "direct":
                    r = http.post(f"{engine}/generate", json=direct_body)
                elif which == "proxy":
                    r = http.post(f"{proxy}/v1/chat/completions", json=chat_body, headers=headers)
                else:  # no X-Group-Id: served, nothing written to Kafka
                    r = http.post(f"{proxy}/v1/chat/completions", json=chat_body,
                                  headers={"X-Session-Id": f"bench-{uuid.uuid4().hex}"})
                elapsed = time.perf_counter() - t0
                r.raise_for_status()
                if i >= warmup:
                    {"direct": direct_s, "proxy": proxy_s, "untracked": untracked_s}[which].append(elapsed)
    ratios = [p / d for p, d in zip(proxy_s, direct_s, strict=True)]
    added = [p - d for p, d in zip(proxy_s, direct_s, strict=True)]
    return {
        "requests": n, "max_tokens": max_tokens,
        "direct_ms": {"p50": pct(direct_s, 50) * 1e3, "p99": pct(direct_s, 99) * 1e3},
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
                with httpx.Client(timeout=120) as client:
                    answers.append(client.post(f"{proxy}/v1/chat/completions", json=body, headers=hdrs).status_code)

            for k in range(inflight):
                calls.append(threading.Thread(target=agent, args=(k,)))
                calls[-1].start()
            deadline = time.monotonic() + 30
            while http.get(f"{proxy}/v1/rollout/state", headers=admin).json()["active"] < inflight:
                if time.monotonic() > deadline:
                    raise RuntimeError("generations did not start")
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
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=10, help="pause/update/resume rounds")
    parser.add_argument("--inflight", type=int, default=8, help="generations in flight during each update")
    parser.add_argument("--stall-step-delay", type=float, default=0.01,
                        help="engine step delay for the stall part, so generations are still running at pause")
    parser.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "rein-bench-proxy.json"))
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="rein-bench-proxy-"))
    procs: list[Proc] = []
    infra = None
    try:
        kafka = args.kafka
        if kafka is None:
            from tests.support.infra import KAFKA, Infra

            infra = Infra(work / "infra")
            kafka = infra.require(KAFKA).address
        engine_proc, engine = start_engine(work / "w1", 0.0, work)
        procs.append(engine_proc)
        proxy_proc, proxy = start_proxy(engine, kafka, work)
        procs.append(proxy_proc)
        over = overhead(engine, proxy, args.requests, args.max_tokens, args.warmup)

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
    print(f"{'':6}{'direct ms':>11}{'proxy ms':>11}{'added ms':>11}{'ratio':>7}{'no-kafka ms':>13}{'ratio':>7}")
    for q in ("p50", "p99"):
        print(f"{q:6}{over['direct_ms'][q]:11.2f}{over['proxy_ms'][q]:11.2f}{over['added_ms'][q]:11.2f}"
              f"{over['ratio'][q]:7.2f}{over['proxy_no_kafka_ms'][q]:13.2f}{over['ratio']['no_kafka_' + q]:7.2f}")
    print(f"\npause -> update -> resume ({st['rounds']} rounds, {st['inflight']} generations in flight)")
    print(f"{'':10}{'pause':>10}{'update':>10}{'resume':>10}{'stall':>10}")
    for row in ("p50", "max"):
        print(f"{row:10}" + "".join(f"{st[row][k]:10.1f}" for k in ("pause_ms", "update_ms", "resume_ms",
                                                                      "stall_ms")))
    print(f"\nwritten {args.out}")


if __name__ == "__main__":
    main()
