"""Where a test run's CPU goes, by kind of process: sample every process's CPU time until stopped.

Run it beside a test run (docs/development.md); on SIGTERM or SIGINT it writes, per kind of process (a
Kafka broker, a rein service by its module, a pytest worker, Docker's parts, ...), the CPU seconds and the
number of processes, and the test module each process was started in (``PYTEST_CURRENT_TEST`` in its
environment). A process's CPU is counted up to its last sample, so a short-lived one may be missed::

    python -m tests.support.cpu_by_process /tmp/cpu.json --every 1 &
    bash .ci/run; kill %1
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from ops.local import warm

_TICK = os.sysconf("SC_CLK_TCK")
_KINDS = (  # (pattern in the command line, kind), the first match wins
    (r"kafka\.Kafka", "kafka broker"), (r"StorageTool", "kafka storage format"), (r"-m (services\.\w+)", r"\1"),
    (r"-m (ops\.\w+|bench\.\w+)", r"\1"), (r"(bench/\w+\.py)", r"\1"), (r"exec\(eval\(sys\.stdin", "pytest worker"),
    (r"pytest", "pytest"), (r"redis-server|redis-sentinel", "redis"), (r"dockerd", "dockerd"),
    (r"containerd-shim", "containerd-shim"), (r"containerd", "containerd"), (r"\bdocker\b", "docker cli"),
    (r"multiprocessing|torchrun|torch\.distributed", "torch workers"), (r"python", "other python"),
)


def kind_of(cmdline: str, comm: str = "") -> str:
    """The kind of a process from its command line; ``?`` for an empty one (a kernel thread, an exec under way).
    A service forked by a warm server (``ops/local/warm.py``) has the server's command line and its own name
    (``comm``, 15 characters at most)."""
    if not cmdline:
        return "?"
    if re.search(r"-m ops\.local\.warm\b", cmdline):
        if comm in ("", "python", "python3"):
            return "warm server"
        return next((f"services.{name}" for name in warm.SERVICES if name[:15] == comm), f"warm child: {comm}")
    for pattern, kind in _KINDS:
        if m := re.search(pattern, cmdline):
            return m.expand(kind)
    return "other: " + Path(cmdline.split()[0]).name


@dataclass
class Seen:
    kind: str
    module: str
    cpu_s: float
    base_s: float = 0.0
    """Its CPU when the sampling began, for a process already running then (not counted)."""


def _read(pid: str) -> tuple[str, float] | None:
    """(start time, CPU seconds) of ``pid``, None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[19], (int(fields[11]) + int(fields[12])) / _TICK  # starttime, utime + stime (proc(5))


def _kind(pid: str) -> str:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        warm_run = "ops.local.warm" in cmdline  # a warm server or its child: only there does the name say more
        return kind_of(cmdline, Path(f"/proc/{pid}/comm").read_text().strip() if warm_run else "")
    except OSError:
        return "?"


def _module(pid: str) -> str:
    """The test module ``pid`` was started in (``PYTEST_CURRENT_TEST``), or ``""``."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return ""
    current = next((e.split(b"=", 1)[1].decode(errors="replace") for e in env
                    if e.startswith(b"PYTEST_CURRENT_TEST=")), "")
    return current.split("::", 1)[0]


def sample(seen: dict[tuple[str, str], Seen], first: bool = False) -> None:
    """Update ``seen`` ((pid, start time) -> what it is and its CPU so far) from /proc; on the ``first`` pass
    the CPU each process already had is its base. The kind is read again each time (a container's first
    process execs its server; one seen mid-exec has no command line yet), the module only once."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or (read := _read(entry)) is None:
            continue
        kind, key = _kind(entry), (entry, read[0])
        if key in seen:
            seen[key].kind, seen[key].cpu_s = kind if kind != "?" else seen[key].kind, read[1]
        else:
            seen[key] = Seen(kind, _module(entry), read[1], read[1] if first else 0.0)


def summary(seen: dict[tuple[str, str], Seen]) -> dict[str, dict[str, list[float]]]:
    """Per kind and per test module: [CPU seconds, processes], the largest first."""
    out: dict[str, dict[str, list[float]]] = {"kinds": {}, "modules": {}}
    for s in seen.values():
        for table, key in (("kinds", s.kind), ("modules", s.module or "(none)")):
            row = out[table].setdefault(key, [0.0, 0])
            row[0] += s.cpu_s - s.base_s
            row[1] += 1
    return {t: {k: [round(v[0], 1), int(v[1])] for k, v in sorted(rows.items(), key=lambda kv: -kv[1][0])}
            for t, rows in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--every", type=float, default=1.0, help="seconds between samples")
    args = parser.parse_args()
    seen: dict[tuple[str, str], Seen] = {}

    def stop(signum: int, frame: FrameType | None) -> None:
        data = summary(seen)
        args.out.write_text(json.dumps(data, indent=1) + "\n")
        total = sum(v[0] for v in data["kinds"].values())
        print(f"{total:.0f} CPU-s sampled; by kind:", file=sys.stderr)
        for kind, (cpu_s, n) in list(data["kinds"].items())[:15]:
            print(f"  {cpu_s:7.1f}  {int(n):4d}  {kind}", file=sys.stderr)
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    sample(seen, first=True)
    while True:
        time.sleep(args.every)
        sample(seen)


if __name__ == "__main__":
    main()
