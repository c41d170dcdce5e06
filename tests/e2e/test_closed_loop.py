"""The closed loop end to end: every service as a real process, several training steps.

One run of the local stack (the same processes ``make demo`` starts), unpaced, with slow
generations (a number and the end of the turn, from a warm start), so weight updates land while
generations are in flight,
and a kill -9 + restart of the trainer in the middle. Then the topics are read
back and checked independently of the services' own bookkeeping.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable

import pytest

from ops.local.stack import LocalStack, SharedInfra, StackConfig, start
from ops.report import optimizer_steps, rows_so_far
from shared.bus import read_topic
from shared.checkpoint import load as load_checkpoint
from shared.schemas import BatchManifest, Chunk, CompletedGroup, WeightApplied, WeightPublished
from shared.settings import KafkaSettings
from shared.versions import real_version
from tests.support.readback import small_stack, wait_bounded_run
from tests.support.wait import wait_on_stack
from tests.support.warm_policy import format_keeping_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(900)]

STEPS = 5
COLLECTORS = 2
RESTART_AT = 2


def _steps(local: LocalStack) -> int:
    """Optimizer steps so far (a batch without gradient is consumed without one)."""
    return len(optimizer_steps(rows_so_far(local.trainer_metrics)))


def _last_trainable_version(mask: list[int], versions: list[str | None]) -> str | None:
    real = [real_version(v) for m, v in zip(mask, versions, strict=True) if m]
    real = [v for v in real if v is not None]
    return real[-1] if real else None


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, stack_infra: Callable[[str], SharedInfra]) -> dict[str, object]:
    config = small_stack(
        tmp_path_factory.mktemp("closed-loop"),
        collectors=COLLECTORS,
        shared_infra=stack_infra("closed-loop"),
        services={
            # Unpaced: the engine keeps generating while the trainer steps, so updates land on
            # generations in flight and the token mask is exercised. Paced, the runner starts a batch's
            # prompts right after an update and they finish before the next (that is pacing's purpose,
            # tested in tests/integration/rollout/test_runner.py), leaving the mask nothing to do.
            "rollout": {"pacing": "off", "max_tokens": 6},
            # From a policy that already answers one valid number: untrained, its replies almost never read as
            # the secret, every reward of a group is equal and a batch has no gradient (99 to 198 batches for
            # the 5 optimizer steps, a wait set by luck); warm, almost every batch trains.
            "trainer": {"max_steps": STEPS,
                        "init_weights": format_keeping_checkpoint(tmp_path_factory.mktemp("warm") / "v0.pt")},
        },
    )
    local = start(config)
    try:
        trainer = next(s for s in local.stack.services if s.name == "trainer")
        wait_on_stack(f"trainer step {RESTART_AT}", lambda: _steps(local) >= RESTART_AT, 300, local,
                      allow_dead=("trainer",))
        assert trainer.proc is not None
        trainer.proc.kill()  # kill -9 in the middle of the run
        trainer.proc.wait(timeout=30)
        trainer.start()
        engine_info = wait_bounded_run(local, STEPS, 420, 60, 120)
        kafka = KafkaSettings(bootstrap_servers=local.infra.kafka_bootstrap)
        topics = local.config.topics
        data = {
            "config": config,
            "engine_info": engine_info,
            "rows": rows_so_far(local.trainer_metrics),
            "chunks": read_topic(kafka, topics.chunks, 60),
            "groups": read_topic(kafka, topics.groups, 60),
            "batches": read_topic(kafka, topics.batches, 60),
            "weights": read_topic(kafka, topics.weights, 60),
        }
    finally:
        local.stop()
    return data


def test_trainer_restart_trains_every_manifest_once_in_order(run: dict[str, object]) -> None:
    rows = run["rows"]
    assert isinstance(rows, list)
    indices = [int(r["manifest_index"]) for r in rows]
    assert indices == list(range(len(rows))), indices
    assert [int(r["step"]) for r in optimizer_steps(rows)] == list(range(1, STEPS + 1))


def test_the_warm_start_gave_almost_every_batch_a_gradient(run: dict[str, object]) -> None:
    # each group of four plays episodes worth 0 to 1 (three in four have unequal rewards, measured), so a batch
    # of four groups without any gradient is rare; untrained, such batches were 95 to 97 % of the run's
    rows = run["rows"]
    assert isinstance(rows, list)
    assert len(rows) - len(optimizer_steps(rows)) <= STEPS, [r.get("skipped") for r in rows]


def test_every_trained_batch_respects_the_window(run: dict[str, object]) -> None:
    seq = {r.version: r.seq for r in run["weights"] if isinstance(r, WeightPublished)}  # type: ignore[attr-defined]
    order = sorted(seq, key=seq.__getitem__)
    index = {label: i for i, label in enumerate(order)}
    groups = {g.group_id: g for g in run["groups"] if isinstance(g, CompletedGroup)}  # type: ignore[attr-defined]
    manifests = {m.index: m for m in run["batches"] if isinstance(m, BatchManifest)}  # type: ignore[attr-defined]
    assert set(range(STEPS)) <= set(manifests)
    checked = 0
    for i in range(STEPS):
        m = manifests[i]
        assert m.window.keep_versions == 2 and m.window.cutoff_index is not None
        for ref in m.groups:
            group = groups[ref.group_id]
            assert not group.failed
            for traj in group.trajectories:
                top = max(traj.segments, key=lambda s: s.segment_index)
                end = _last_trainable_version(top.loss_mask, top.versions)
                if end is not None:
                    assert index[end] >= m.window.cutoff_index, (i, ref.group_id, end, m.window)
                    checked += 1
    assert checked > 0, "no trained trajectory carried a real version: the window check checked nothing"


def test_masked_tokens_are_exactly_the_non_last_version_ones(run: dict[str, object]) -> None:
    groups = {g.group_id: g for g in run["groups"] if isinstance(g, CompletedGroup)}  # type: ignore[attr-defined]
    manifests = {m.index: m for m in run["batches"] if isinstance(m, BatchManifest)}  # type: ignore[attr-defined]
    rows = {int(r["manifest_index"]): r for r in run["rows"]}  # type: ignore[attr-defined]
    mixed_seen = 0
    for i, row in rows.items():
        expected = 0
        for ref in manifests[i].groups:
            for traj in groups[ref.group_id].trajectories:
                for seg in traj.segments:
                    mask = list(seg.loss_mask)
                    if mask:
                        mask[0] = 0
                    last = _last_trainable_version(mask, seg.versions)
                    trainable_real = {real_version(v) for m, v in zip(mask, seg.versions, strict=True) if m} - {None}
                    if len(trainable_real) >= 2:
                        mixed_seen += 1
                        expected += sum(
                            1 for m, v in zip(mask, seg.versions, strict=True) if m and real_version(v) != last
                        )
        assert row["version_masked_tokens"] == expected, (i, row["version_masked_tokens"], expected)
    assert mixed_seen > 0, "no sample spanned two versions: the run did not exercise the token mask"


def test_held_generation_resumed_on_the_new_version(run: dict[str, object]) -> None:
    calls: dict[tuple[str, int], list[Chunk]] = defaultdict(list)
    for c in run["chunks"]:  # type: ignore[attr-defined]
        if isinstance(c, Chunk):
            calls[(c.session_id, c.seq - c.chunk_index)].append(c)
    resumed = []
    for chunks in calls.values():
        chunks.sort(key=lambda c: c.chunk_index)
        for a, b in itertools.pairwise(chunks):
            assert a.finish_reason == "abort", "only an aborted chunk is ever continued"
            assert b.context_ids == []
            if a.version != b.version:
                resumed.append((a.version, b.version))
    assert resumed, "no generation was preempted by a weight update and resumed"
    seq = {r.version: r.seq for r in run["weights"] if isinstance(r, WeightPublished)}  # type: ignore[attr-defined]
    assert all(seq[new] > seq[old] for old, new in resumed if old in seq and new in seq)


def test_engine_weights_match_the_trainers_checkpoint(run: dict[str, object]) -> None:
    info = run["engine_info"]
    assert isinstance(info, dict)
    config = run["config"]
    assert isinstance(config, StackConfig)
    ckpt = load_checkpoint(config.run_dir / "weights" / f"v{STEPS}.pt")
    assert info["digest"] == ckpt.digest
    applied = [r for r in run["weights"] if isinstance(r, WeightApplied) and r.version == f"v{STEPS}"]  # type: ignore[attr-defined]
    assert applied and applied[-1].digest == ckpt.digest
