"""What a run's generated tokens became, read back from its topics and the trainer's lines (shared by the
bench scripts): trained, dropped by the window, dropped without signal, failed, masked."""

from __future__ import annotations

from typing import Any

from ops.local.stack import LocalStack
from ops.report import rows_so_far
from shared.bus import read_topic
from shared.names import Topics
from shared.schemas import BatchManifest, CompletedGroup, DecisionRecord
from shared.settings import KafkaSettings
from shared.window_view import trainable_tokens


def token_accounting(local: LocalStack, steps: int) -> dict[str, Any]:
    """Generated tokens of every decided group, split by what became of them.

    Only groups with a final outcome count: dropped by the window, dropped without signal
    (rewards all equal), failed (a session rejected or errored), or in one of the first
    ``steps`` manifests (trained, minus the tokens the version mask removed). Groups still
    pending at the end are left out. ``untrained_fraction`` counts every cause;
    ``stale_fraction`` only staleness's (window, span cap, mask).
    """
    kafka = KafkaSettings(bootstrap_servers=local.infra.kafka_bootstrap)
    topics = Topics()
    groups = {g.group_id: g for g in read_topic(kafka, topics.groups, 120) if isinstance(g, CompletedGroup)}
    final: dict[str, str] = {}
    for d in sorted(
        (d for d in read_topic(kafka, topics.decisions, 120) if isinstance(d, DecisionRecord)),
        key=lambda d: d.step or 0,
    ):
        final[d.group_id] = d.decision
    trained = {
        ref.group_id
        for m in read_topic(kafka, topics.batches, 120)
        if isinstance(m, BatchManifest) and m.index < steps
        for ref in m.groups
    }

    def tokens(group_id: str) -> int:
        group = groups.get(group_id)
        return 0 if group is None else trainable_tokens(group)

    out: dict[str, Any] = {"tokens_dropped_stale": 0, "tokens_no_signal": 0, "tokens_failed": 0,
                           "tokens_in_trained_batches": 0}
    for gid, decision in final.items():
        if gid in trained:
            out["tokens_in_trained_batches"] += tokens(gid)
        elif decision in ("dropped_stale", "dropped_retroactive"):
            out["tokens_dropped_stale"] += tokens(gid)
        elif decision == "dropped_no_signal":
            out["tokens_no_signal"] += tokens(gid)
        elif decision in ("failed_retry", "failed_dropped"):
            out["tokens_failed"] += tokens(gid)
    out["tokens_masked"] = sum(
        int(r.get("version_masked_tokens") or 0) for r in rows_so_far(local.trainer_metrics)[:steps]
    )
    decided = ("tokens_dropped_stale", "tokens_no_signal", "tokens_failed", "tokens_in_trained_batches")
    total = sum(out[k] for k in decided)
    stale = out["tokens_dropped_stale"] + out["tokens_failed"] + out["tokens_masked"]
    out["tokens_generated"] = total
    out["untrained_fraction"] = (stale + out["tokens_no_signal"]) / total if total else None
    out["stale_fraction"] = stale / total if total else None
    return out
