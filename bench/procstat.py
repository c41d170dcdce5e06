"""CPU time of the local stack's processes, read from ``/proc`` (shared by the bench scripts)."""

from __future__ import annotations

import os
from pathlib import Path

from ops.local.stack import LocalStack

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` and its live descendants, in seconds (0 when it is gone)."""
    total = 0.0
    for p in [pid, *_descendants(pid)]:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        total += (int(fields[11]) + int(fields[12])) / _TICK  # fields 14 and 15 of proc(5)
    return total


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def service_pids(local: LocalStack) -> dict[str, int]:
    """Every process of the stack by name: the services, the Kafka JVM and redis-server."""
    pids = {s.name: s.pid for s in local.stack.services}
    for name, pid_file in (("kafka", "kafka/pid"), ("redis", "redis/redis.pid")):
        path = local.infra.data_dir / pid_file
        if path.exists():
            pids[name] = int(path.read_text().strip())
    return pids


def snapshot(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of each named process."""
    return {name: cpu_seconds(pid) for name, pid in pids.items()}


def cpu_split(before: dict[str, float], after: dict[str, float]) -> dict[str, dict[str, float]]:
    """CPU seconds per process over an interval, and each one's share of their sum (the busy CPU)."""
    used = {name: max(0.0, after.get(name, 0.0) - before.get(name, 0.0)) for name in before}
    busy = sum(used.values())
    return {name: {"cpu_s": round(s, 3), "share": round(s / busy, 4) if busy else 0.0} for name, s in used.items()}
