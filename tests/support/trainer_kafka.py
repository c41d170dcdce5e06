"""Harness of the trainer's integration tests (``tests/integration/trainer/``): a trainer's own topics on
the session's real Kafka, the groups and manifests written to them, and what a run leaves behind.

- :func:`completed_group` / :func:`batch_manifest`: numbered groups of four trajectories (half their
  tokens masked, versions mixed) and the manifests that reference them.
- :class:`TrainerEnv`: one test's topics, consumer group and directories; writes groups and manifests,
  builds the trainer's settings, reads ``metrics.jsonl`` and the ``weights`` topic back.
- :func:`check_checkpoints`: the published versions are ``v0..vN`` and each checkpoint is what its
  ``WeightPublished`` says.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from kafka import TopicPartition

from services.trainer.settings import TrainerSettings
from shared import checkpoint
from shared.bus import Consumer, Delivered, Producer
from shared.names import Topics
from shared.schemas import (
    BatchManifest,
    CompletedGroup,
    GapInfo,
    GroupRef,
    Record,
    Segment,
    Trajectory,
    WeightPublished,
    WindowInfo,
)
from shared.settings import KafkaSettings, load
from shared.tokenizer import TOKENIZER

WINDOW = WindowInfo(keep_versions=2, current_version="v0", current_index=0, cutoff_index=0)


def completed_group(i: int, rewards: tuple[float, ...] = (1.0, 0.0, 0.5, 0.0)) -> CompletedGroup:
    trajs = []
    for k, reward in enumerate(rewards):
        ids = [3 + (i + k + j) % (TOKENIZER.vocab_size - 3) for j in range(12)]
        mask = [0] * 4 + [1] * 8
        versions: list[str | None] = [None] * 4 + ["v0"] * 4 + ["v1"] * 4  # mixed: half masked
        trajs.append(
            Trajectory(
                session_id=f"s{i}-{k}",
                status="completed",
                reward=reward,
                segments=[
                    Segment(
                        segment_index=0,
                        token_ids=ids,
                        loss_mask=mask,
                        logprobs=[0.0] * 4 + [-3.0] * 8,
                        versions=versions,
                    )
                ],
            )
        )
    return CompletedGroup(group_id=f"g{i}", prompt_id=f"p{i}", failed=False, trajectories=trajs)


def batch_manifest(index: int, refs: list[GroupRef]) -> BatchManifest:
    return BatchManifest(
        batch_id=f"b{index}",
        index=index,
        groups=refs,
        window=WINDOW,
        version_gap=GapInfo(min=0, max=1, mean=0.5),
        drops_in_batch=0,
        drops_cumulative=0,
    )


class TrainerEnv:
    """One test's topics, consumer group and directories, with a producer of its groups and manifests."""

    def __init__(self, kafka: KafkaSettings, topics: Topics, tmp: Path, group: str) -> None:
        self.kafka, self.topics, self.tmp, self.group = kafka, topics, tmp, group
        self.producer = Producer(kafka, client_suffix="test")

    def groups(self, n: int, start: int = 0, rewards: tuple[float, ...] | None = None) -> list[GroupRef]:
        refs = []
        for i in range(start, start + n):
            group = completed_group(i) if rewards is None else completed_group(i, rewards)
            d: Delivered = self.producer.send(self.topics.groups, group)
            refs.append(GroupRef(group_id=f"g{i}", partition=d.partition, offset=d.offset))
        return refs

    def manifests(self, items: list[BatchManifest]) -> None:
        for m in items:
            self.producer.send(self.topics.batches, m)

    def settings(self, **overrides: object) -> TrainerSettings:
        values: dict[str, object] = {
            "kafka": self.kafka, "topics": self.topics, "weights_dir": self.tmp / "weights",
            "run_dir": self.tmp / "run", "consumer_group": self.group, "metrics_port": 0, "torch_threads": 1,
            "log_json": False,
        }
        return load(TrainerSettings, **(values | overrides))

    def lines(self) -> list[dict[str, Any]]:
        path = self.tmp / "run" / "metrics.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    def weight_records(self) -> list[Record]:
        """Every record on ``weights``, read to the end the topic has now."""
        reader = Consumer(self.kafka, (), None, client_suffix="test-weights")
        try:
            raw = reader.raw
            tps = [TopicPartition(self.topics.weights, p) for p in range(4)]
            raw.assign(tps)
            raw.seek_to_beginning(*tps)
            end = raw.end_offsets(tps)
            out: list[Record] = []
            deadline = time.monotonic() + 30
            while any(raw.position(tp) < end[tp] for tp in tps) and time.monotonic() < deadline:
                out += [p.record for p in reader.poll(0.5)]
            return out
        finally:
            reader.close()

    def published(self, want: int, timeout_s: float = 30.0) -> list[WeightPublished]:
        consumer = Consumer(self.kafka, [self.topics.weights], f"{self.group}-reader", client_suffix="test-reader")
        out: dict[str, WeightPublished] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(out) < want and time.monotonic() < deadline:
                for p in consumer.poll(0.5):
                    if isinstance(p.record, WeightPublished):
                        out[p.record.version] = p.record
        finally:
            consumer.close()
        return sorted(out.values(), key=lambda e: e.seq)

    def close(self) -> None:
        self.producer.close()


def check_checkpoints(env: TrainerEnv, events: list[WeightPublished], steps: int) -> None:
    assert [e.seq for e in events] == list(range(steps + 1))
    for e in events:
        assert e.version == f"v{e.seq}" and e.step == e.seq
        ckpt = checkpoint.load(e.path)
        assert ckpt.digest == e.digest and ckpt.version == e.version and ckpt.step == e.step
