"""CPU per chat call of each process of the demo pipeline, and (optionally) py-spy profiles.

Starts the local stack as ``make demo`` does for the tiny policy (``bench/pipeline.py``'s
``demo_config``: the tiny preset's task, batch and collectors, or ``--demo-flag`` ones), lets
``--warmup`` trainer steps pass, then measures a window of ``--steps`` trainer steps:

* CPU seconds of every process (``utime + stime`` from ``/proc/<pid>/stat``, with its
  descendants; ``bench/procstat.py``), its share of the busy CPU, and CPU milliseconds per chat call;
* chat calls and episodes per second (the proxy's and the runner's ``/metrics``);
* with ``--idle S``: after the window, the rollout runner stopped (SIGSTOP, so no episode starts; in-flight
  work gets ``IDLE_SETTLE_S`` to end), CPU milliseconds per second of every process over S seconds: what
  a stack costs while it waits (a sync wave's trainer phase, a run paced by its trainer, the tests' stacks);
* with ``--profile proxy rollout ...``: a ``py-spy record`` of each named process over
  the window (raw collapsed stacks, no line numbers), summarised as the top entries by
  self and by cumulative samples; ``--gil`` keeps only samples holding the GIL, the
  process's Python CPU, where py-spy's idle detection fails (a VM) and blocked threads count.

The script runs the services of the checkout it is in, so two checkouts can be compared
back to back with identical settings::

    $V/bin/python bench/hot_path.py --steps 10 --out /tmp/hot-after.json
    (cd ../base && $V/bin/python bench/hot_path.py --steps 10 --out /tmp/hot-before.json)
    $V/bin/python bench/hot_path.py --profile proxy rollout --steps 10 --out /tmp/hot-prof.json

py-spy is not a project dependency (``pip install py-spy``) and needs ptrace.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.pipeline import demo_config
from bench.procstat import service_pids, snapshot
from ops.local.stack import start
from ops.report import rows_so_far
from shared.settings import setting_loc

IDLE_SETTLE_S = 3.0
"""With ``--idle``: seconds between stopping the runner and the idle window."""
_CHAT = re.compile(r'^rein_proxy_requests_total\{route="/v1/chat/completions",status="200"\}\s+(\S+)$', re.M)
_EPISODES = re.compile(r"^rein_rollout_episodes_total\{[^}]*\}\s+(\S+)$", re.M)


def total(pattern: re.Pattern[str], url: str) -> float:
    return sum(float(v) for v in pattern.findall(httpx.get(url, timeout=5).text))


def summarise(raw: Path, top: int) -> dict[str, list[tuple[str, float]]]:
    """Top functions of a py-spy raw file by self samples and by cumulative samples (in % of all)."""
    own: Counter[str] = Counter()
    cumulative: Counter[str] = Counter()
    samples = 0
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        frames = [f for f in stack.split(";") if not f.startswith("process ") and not f.startswith("thread ")]
        if not frames:
            continue
        samples += count
        own[frames[-1]] += count
        for frame in set(frames):
            cumulative[frame] += count

    def pct(counter: Counter[str]) -> list[tuple[str, float]]:
        return [(name, round(100 * n / samples, 1)) for name, n in counter.most_common(top)]

    return {"self": pct(own), "cumulative": pct(cumulative), "samples": [("all", float(samples))]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--warmup", type=int, default=3, help="trainer steps before the window")
    p.add_argument("--steps", type=int, default=10, help="trainer steps in the measured window")
    p.add_argument("--profile", nargs="*", default=[], help="services to record with py-spy (proxy, rollout, engine)")
    p.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    p.add_argument("--gil", action="store_true",
                   help="record only samples holding the GIL (py-spy --gil): a thread blocked in C (a queue, a "
                        "selector) otherwise counts as busy where py-spy cannot tell idle threads apart")
    p.add_argument("--idle", type=float, default=0, metavar="S",
                   help="after the window, measure S seconds with the rollout runner stopped (0: not)")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--timeout-s", type=float, default=900)
    p.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "rein-hot-path.json")
    p.add_argument("--env", action="append", default=[], metavar="SERVICE:VAR=VALUE",
                   help="a setting of one service of the stack by its variable (repeatable): "
                        "proxy:REIN_KAFKA__LINGER_MS=20; SERVICE 'collector' means every collector")
    p.add_argument("--demo-flag", action="append", default=[], metavar="FLAG",
                   help="a flag of make demo's stack (repeatable): --demo-flag=--collectors=1")
    args = p.parse_args()
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    run_dir = Path(tempfile.mkdtemp(prefix="rein-hot-path-"))
    config = demo_config(args.warmup + args.steps + 2, 0, run_dir, args.demo_flag)
    for item in args.env:  # REIN_KAFKA__LINGER_MS=20 is the setting kafka.linger_ms, checked when the stack starts
        service, _, setting = item.partition(":")
        name, _, value = setting.partition("=")
        *outer, last = setting_loc(name)
        target = config.services.setdefault(service, {})
        for part in outer:
            target = target.setdefault(part, {})
        target[last] = value
    local = start(config)
    spies: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
    try:
        deadline = time.monotonic() + args.timeout_s

        def wait_steps(n: int) -> None:
            while len(rows_so_far(local.trainer_metrics)) < n:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{len(rows_so_far(local.trainer_metrics))}/{n} steps in {args.timeout_s}s")
                dead = [s.name for s in local.stack.dead()]
                if dead:
                    raise RuntimeError(f"{dead} died; logs in {run_dir / 'logs'}")
                time.sleep(0.2)

        wait_steps(args.warmup)
        pids = service_pids(local)
        for name in args.profile:
            out = run_dir / f"{name}.pyspy.txt"
            spies[name] = (subprocess.Popen(
                [py_spy, "record", "-p", str(pids[name]), "-r", str(args.rate), "-f", "raw", "--nolineno",
                 "--nonblocking", *(["--gil"] if args.gil else []), "-o", str(out)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), out)
        proxy_metrics, rollout_metrics = f"{local.urls['proxy']}/metrics", f"{local.urls['rollout']}/metrics"
        t0, cpu0 = time.monotonic(), snapshot(pids)
        chat0, ep0 = total(_CHAT, proxy_metrics), total(_EPISODES, rollout_metrics)
        wait_steps(args.warmup + args.steps)
        t1, cpu1 = time.monotonic(), snapshot(pids)
        chat1, ep1 = total(_CHAT, proxy_metrics), total(_EPISODES, rollout_metrics)
        for proc, _ in spies.values():
            proc.send_signal(signal.SIGINT)
        for proc, _ in spies.values():
            proc.wait(60)
        idle: dict[str, float] = {}
        if args.idle:
            os.kill(pids["rollout"], signal.SIGSTOP)
            try:
                time.sleep(IDLE_SETTLE_S)  # in-flight calls and groups end; a fixed span, nothing to await
                i0, before = time.monotonic(), snapshot(pids)
                time.sleep(args.idle)
                after, elapsed = snapshot(pids), time.monotonic() - i0
                idle = {n: round(1e3 * (after[n] - before[n]) / elapsed, 1) for n in pids}
            finally:
                os.kill(pids["rollout"], signal.SIGCONT)
    finally:
        for proc, _ in spies.values():
            if proc.poll() is None:
                proc.kill()
        local.stop()
    wall, chats, episodes = t1 - t0, chat1 - chat0, ep1 - ep0
    used = {n: cpu1[n] - cpu0[n] for n in pids}
    busy = sum(used.values())
    rows = [{"process": n, "cpu_s": round(c, 2), "share": round(c / busy, 3),
             "cpu_ms_per_chat": round(1e3 * c / chats, 3) if chats else None}
            for n, c in sorted(used.items(), key=lambda kv: -kv[1])]
    profiles = {name: summarise(out, args.top) for name, (_, out) in spies.items() if out.exists()}
    result = {"wall_s": wall, "chat_calls": chats, "episodes": episodes, "chat_per_s": chats / wall,
              "episodes_per_s": episodes / wall, "busy_cpu_s": busy, "processes": rows, "profiles": profiles,
              "idle_cpu_ms_per_s": idle, "profiled": args.profile, "rate": args.rate, "gil": args.gil,
              "run_dir": str(run_dir)}
    args.out.write_text(json.dumps(result, indent=2))
    print(f"window: {args.steps} steps, {wall:.1f} s, {chats:.0f} chat calls ({chats / wall:.1f}/s), "
          f"{episodes:.0f} episodes ({episodes / wall:.2f}/s), busy CPU {busy:.1f} s")
    print(f"{'process':<12} {'cpu s':>7} {'share':>6} {'cpu ms/chat':>11}")
    for r in rows:
        print(f"{r['process']:<12} {r['cpu_s']:>7.2f} {r['share']:>6.1%} {r['cpu_ms_per_chat'] or 0:>11.3f}")
    if idle:
        print(f"\nidle, the runner stopped ({args.idle:.0f} s): CPU ms per second, {sum(idle.values()):.1f} in all")
        for n, v in sorted(idle.items(), key=lambda kv: -kv[1]):
            print(f"{n:<12} {v:>7.1f}")
    for name, prof in profiles.items():
        for kind in ("self", "cumulative"):
            print(f"\n{name}: top by {kind} (% of {prof['samples'][0][1]:.0f} samples)")
            for frame, share in prof[kind]:
                print(f"{share:>6.1f}  {frame}")
    print(f"\nwritten {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
