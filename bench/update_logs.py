"""A weight update as the services' JSON logs record it: how long each proxy held admission closed (its
``paused`` / ``resumed`` lines) and each phase of the broadcaster's round (its ``update_round`` lines).
Shared by the bench scripts."""

from __future__ import annotations

import contextlib
import json
import statistics
from datetime import datetime
from typing import Any


def pause_stalls(lines: list[str]) -> list[dict[str, Any]]:
    """Per weight update, how long the proxy held admission closed, from its JSON log lines.

    A ``paused`` line is logged when the pause returns, ``waited_s`` after admission closed;
    the matching ``resumed`` line (same ``pause_id``, ``status: resumed``) is when it reopened.
    """
    paused: dict[str, tuple[float, dict[str, Any]]] = {}
    out: list[dict[str, Any]] = []
    for line in lines:
        if not line.startswith("{"):
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        event, pause_id, ts = rec.get("event"), rec.get("pause_id"), rec.get("timestamp")
        if not pause_id or not isinstance(ts, str) or event not in ("paused", "resumed"):
            continue
        at = datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()
        if event == "paused" and rec.get("status", "paused") == "paused":
            paused.setdefault(pause_id, (at - float(rec.get("waited_s") or 0.0), rec))
        elif event == "resumed" and rec.get("status") == "resumed" and pause_id in paused:
            closed, prec = paused.pop(pause_id)
            out.append({"pause_id": pause_id, "reason": prec.get("reason"), "version": rec.get("version"),
                        "closed_at": closed, "stall_ms": (at - closed) * 1e3,
                        "pause_ms": float(prec.get("waited_s") or 0.0) * 1e3,
                        "preempted": prec.get("preempted"), "held": rec.get("held")})
    return out


def update_phases(lines: list[str]) -> dict[str, dict[str, float]]:
    """p50 / p99 ms of each phase of an applied update as the broadcaster saw it (its ``update_round``
    lines: every pause answer in, the renewal, the engines' update, every resume answer in)."""
    rounds: list[dict[str, Any]] = []
    for line in lines:
        if line.startswith("{") and '"update_round"' in line:
            with contextlib.suppress(ValueError):
                rec = json.loads(line)
                if "update_s" in rec:
                    rounds.append(rec)
    out: dict[str, dict[str, float]] = {}
    for key in ("pause_s", "renew_s", "update_s", "resume_s", "total_s"):
        ordered = sorted(float(r[key]) * 1e3 for r in rounds if key in r)
        if ordered:
            p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
            out[key.removesuffix("_s")] = {"p50_ms": round(statistics.median(ordered), 1), "p99_ms": round(p99, 1)}
    return out


def stall_summary(stalls: list[dict[str, Any]]) -> dict[str, Any]:
    ms = [s["stall_ms"] for s in stalls]
    if not ms:
        return {"updates": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    ordered = sorted(ms)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"updates": len(ms), "p50_ms": round(statistics.median(ms), 1), "p99_ms": round(p99, 1),
            "max_ms": round(max(ms), 1), "pause_p50_ms": round(statistics.median(s["pause_ms"] for s in stalls), 1)}
