"""``rein status`` as a text table: presentation only, over the report :func:`ops.status.collect` returns."""

from __future__ import annotations

from typing import Any


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _segments(counts: dict[str, float]) -> str:
    """Segments started: a session's first apart from those that re-tokenized a history, by reason."""
    if not counts:
        return "none"
    fallbacks = {k: v for k, v in counts.items() if k != "first"}
    reasons = ", ".join(f"{k} {_fmt(v)}" for k, v in sorted(fallbacks.items(), key=lambda kv: (-kv[1], kv[0])))
    return (f"{_fmt(sum(counts.values()))} ({_fmt(counts.get('first', 0.0))} first; "
            f"{_fmt(sum(fallbacks.values()))} re-tokenized a history{': ' + reasons if reasons else ''})")


def render(report: dict[str, Any]) -> str:
    """The report as a human-readable text table."""
    lines: list[str] = []
    add = lines.append
    redis_info = report["redis"]
    if "error" in redis_info:
        add(f"redis: ERROR {redis_info['error']}")
    else:
        add(f"redis: {redis_info['url']} (key prefix {redis_info['key_prefix']!r})")
        w = report["window"]
        add("")
        add("window")
        add(f"  current version  {_fmt(w['current_version'])} (index {_fmt(w['current_index'])})")
        add(f"  cutoff           index {_fmt(w['cutoff_index'])} ({_fmt(w['cutoff_version'])})")
        add(f"  keep_versions    {_fmt(w['keep_versions'])}   batch_groups {_fmt(w['batch_groups'])}"
            f"   max_retries {_fmt(w['max_retries'])}   no_signal_groups {_fmt(w.get('no_signal_groups'))}"
            f"   stale_groups {_fmt(w.get('stale_groups'))}")
        add(f"  pending groups   {w['pending_groups']}   batches {w['batches']}   steps {w['steps']}"
            f"   outbox {w['outbox']}   groups without signal in a row {w.get('no_signal_run', 0)}")
        d = report["drops"]
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(d["by_reason"].items())) or "none"
        add(f"  drops            {d['total']} total ({reasons}); {d['since_last_batch']} since the last batch;"
            f" {d['prompts_dropped_after_retries']} prompts dropped after retries")
        u = report["untrained_tokens"]
        causes = ", ".join(f"{k} {v}" for k, v in u["by_cause"].items())
        share = "" if u["share"] is None else f" ({u['share']:.1%})"
        add(f"  untrained tokens {u['total']} of {u['generated']} generated{share}: {causes}"
            " (version-masked: the trainer's metrics.jsonl)")
        reg = report["registry"]
        add("")
        add(f"registry ({len(reg['published'])} published, {len(reg['unregistered'])} unregistered)")
        shown = reg["published"][-10:]
        if len(reg["published"]) > len(shown):
            add(f"  ... {len(reg['published']) - len(shown)} older")
        for row in shown:
            mark = "  <- current" if row["label"] == w["current_version"] else ""
            add(f"  [{row['index']:>4}] {row['label']:<24} seq {row['seq']}{mark}")
        for row in reg["unregistered"]:
            add(f"  [{row['index']:>4}] {row['label']:<24} UNREGISTERED")
        registered = report.get("registered_proxies") or []
        add("")
        add(f"registered proxies ({len(registered)}; the broadcaster pauses these and REIN_PROXY_URLS)")
        for url in registered:
            add(f"  {url}")
        engines = report.get("registered_engines") or []
        add(f"registered engines ({len(engines)}; proxies with REIN_DISCOVER_ENGINES route to these, the broadcaster "
            "updates them and REIN_ENGINE_URLS)")
        for url in engines:
            add(f"  {url}")
    add("")
    groups = report["consumer_groups"]
    if "error" in groups:
        add(f"consumer lag: ERROR {groups['error']}")
    else:
        add(f"consumer lag ({groups['bootstrap']})")
        add(f"  {'group':<26} {'lag':>8}  {'state':<14} members  partitions behind")
        for name, g in groups["groups"].items():
            if "error" in g:
                add(f"  {name:<26} ERROR {g['error']}")
                continue
            behind = [f"{p['topic']}/{p['partition']}:{p['lag']}" for p in g["partitions"] if p["lag"]]
            note = "" if g.get("committed") else " (no commits)"
            add(f"  {name:<26} {g['lag']:>8}  {g.get('state', '-'):<14} {_fmt(g.get('members')):>7}  "
                f"{' '.join(behind[:6]) or '-'}{' ...' if len(behind) > 6 else ''}{note}")
    add("")
    add("proxies" if report["proxies"] else "proxies: none given (--proxy or --run-dir)")
    for row in report["proxies"]:
        if "error" in row and "paused" not in row:
            add(f"  {row['url']}: ERROR {row['error']}")
            continue
        state = "PAUSED" if row.get("paused") else "running"
        extra = f" ({row['reason']})" if row.get("paused") and row.get("reason") else ""
        add(f"  {row['url']}: {state}{extra}  pauses {_fmt(row.get('pauses'))}  active {_fmt(row.get('active'))}"
            f"  held {_fmt(row.get('held'))}  sessions {_fmt(row.get('live_sessions'))}")
        if "error" in row:
            add(f"    ERROR {row['error']}")
    add("engines" if report["engines"] else "engines: none given (--engine or --run-dir)")
    for row in report["engines"]:
        if "error" in row:
            add(f"  {row['url']}: ERROR {row['error']}")
        else:
            add(f"  {row['url']}: version {_fmt(row['weight_version'])}  active {_fmt(row.get('active_requests'))}")
    rejections = report["rejections"]
    add("rejections (proxies, since start): " + (
        ", ".join(f"{k} {_fmt(v)}" for k, v in sorted(rejections.items())) or "none"))
    add("new segments (proxies, since start): " + _segments(report.get("new_segments") or {}))
    if report["services"]:
        add("")
        add("services")
        for name, row in report["services"].items():
            status = "ok" if row.get("ok") else f"DOWN ({row.get('error', 'unhealthy')})"
            add(f"  {name:<14} {row['url']:<28} {status}")
    return "\n".join(lines)
