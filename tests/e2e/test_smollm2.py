"""The real SmolLM2-135M-Instruct trained for 2 steps through the whole pipeline on CPU.

The local stack (the processes ``make demo MODEL=smollm2`` starts) with ``REIN_MODEL`` = the
converted SmolLM2 directory for trainer, engine and proxy, and the arithmetic task played by
the rollout runner through the proxy's chat route. As small as a real run gets: one
group of 2 episodes per batch, replies of at most 16 tokens, sync mode (each wave is generated
by the newest weights, so step 2's batch is sampled by exactly the weights the trainer holds
and the trainer/engine logprob difference is the numerical mismatch alone, not staleness).

Checked from the outside: the engine serves the trainer's final checkpoint (digest), every
chunk and trained token carries the version that sampled it, and the trainer's logprob of the
sampled tokens is close to the engine's (``train_rollout_logprob_abs_diff``, printed).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ops.local.stack import SharedInfra, StackConfig, start
from ops.report import optimizer_steps, rows_so_far
from shared.bus import read_topic
from shared.model import load_family
from shared.schemas import BatchManifest, Chunk, CompletedGroup, WeightApplied
from shared.settings import KafkaSettings
from shared.versions import real_version
from tests.support.readback import wait_bounded_run

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(1200)]

STEPS = 2
MAX_ABS_DIFF = 1e-3
"""Bound on the mean |trainer - engine| logprob of trained tokens: both run the same fp32 weights
on CPU, the engine with a KV cache one token at a time, the trainer in one padded forward.
Measured: ~3.5e-6 per step; a shifted token, a wrong temperature or a stale weight is far above 1e-3."""


@pytest.fixture(scope="module")
def run(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory,
        stack_infra: Callable[[str], SharedInfra]) -> dict[str, Any]:
    config = StackConfig(
        run_dir=tmp_path_factory.mktemp("smollm2"),
        shared_infra=stack_infra("smollm2"),
        collectors=1,
        batch_groups=1,
        mode="sync",
        model=str(smollm2_dir),
        services={
            "trainer": {"max_steps": STEPS, "lr": 1e-5, "weight_decay": 0.0, "keep_checkpoints": 2},
            "proxy": {"max_preempts": 2},
            "rollout": {"group_size": 2, "max_concurrent_groups": 1, "task": "arithmetic", "max_tokens": 16},
        },
        startup_timeout_s=300.0,
        stop_timeout_s=60.0,
    )
    local = start(config)
    try:
        engine_info = wait_bounded_run(local, STEPS, 600, 120, 180)
        kafka = KafkaSettings(bootstrap_servers=local.infra.kafka_bootstrap)
        topics = local.config.topics
        data: dict[str, Any] = {
            "config": config,
            "engine_info": engine_info,
            "rows": rows_so_far(local.trainer_metrics),
            "chunks": [c for c in read_topic(kafka, topics.chunks, 60) if isinstance(c, Chunk)],
            "groups": [g for g in read_topic(kafka, topics.groups, 60) if isinstance(g, CompletedGroup)],
            "batches": [b for b in read_topic(kafka, topics.batches, 60) if isinstance(b, BatchManifest)],
            "applied": [w for w in read_topic(kafka, topics.weights, 60) if isinstance(w, WeightApplied)],
        }
    finally:
        local.stop()
    return data


def test_engine_serves_the_trainers_final_checkpoint(run: dict[str, Any], smollm2_dir: Path) -> None:
    config: StackConfig = run["config"]
    weights = config.run_dir / "weights"
    sidecar = json.loads((weights / f"v{STEPS}.json").read_text())
    assert run["engine_info"]["digest"] == sidecar["digest"]
    # the checkpoint directory itself hashes to that digest (load verifies it) and is an HF directory
    loaded = load_family(str(smollm2_dir)).load(weights / f"v{STEPS}", torch.device("cpu"))
    assert loaded.digest == sidecar["digest"] and loaded.version == f"v{STEPS}"
    assert (weights / f"v{STEPS}" / "config.json").is_file()
    applied = [w for w in run["applied"] if w.version == f"v{STEPS}"]
    assert applied and applied[-1].digest == sidecar["digest"]
    assert not (weights / "v0.json").exists(), "keep_checkpoints=2 should have pruned step 0"


def test_every_chunk_and_trained_token_carries_its_version(run: dict[str, Any]) -> None:
    chunks: list[Chunk] = run["chunks"]
    assert chunks
    for c in chunks:
        assert real_version(c.version) in {f"v{i}" for i in range(STEPS + 1)}, c.version
        assert len(c.logprobs) == len(c.output_ids)
        if c.token_versions:
            assert sum(n for _, n in c.token_versions) == len(c.output_ids)
    groups = {g.group_id: g for g in run["groups"]}
    manifests = {m.index: m for m in run["batches"]}
    for row in run["rows"]:
        index, held = int(row["manifest_index"]), int(row["step"]) - (0 if row.get("skipped") else 1)
        seen: set[str | None] = set()
        for ref in manifests[index].groups:
            for traj in groups[ref.group_id].trajectories:
                for seg in traj.segments:
                    assert len(seg.versions) == len(seg.token_ids) == len(seg.loss_mask)
                    seen |= {real_version(v) for m, v in zip(seg.loss_mask, seg.versions, strict=True) if m}
        # sync mode: each batch was sampled entirely by the weights the trainer held when it took it
        # (v<s> for step s+1; a batch skipped without an update leaves v<s> for the next one)
        assert seen == {f"v{held}"}, (index, held, seen)


def test_trainer_logprobs_match_the_engines(run: dict[str, Any]) -> None:
    rows = optimizer_steps(run["rows"])  # a batch skipped before the forward pass has no diff
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    diffs = [float(r["train_rollout_logprob_abs_diff"]) for r in rows]
    tokens = [int(r["trained_tokens"]) for r in rows]
    print(f"\nSmolLM2 train/engine mean |logprob diff| per step: {diffs} over {tokens} trained tokens")
    assert all(t > 0 for t in tokens), tokens
    assert all(d < MAX_ABS_DIFF for d in diffs), diffs
