"""The trainer against a real Kafka: manifests in index order, exactly once, across restarts.

Groups go to ``rollout.groups`` and manifests to ``train.batches`` (unique topics per
test) through ``shared.bus.Producer``; the trainer runs in-process (bounded by
``max_steps``) or as a subprocess killed with SIGKILL in the middle. Assertions read
``metrics.jsonl`` (one line per durable manifest), the checkpoints and the ``weights`` topic.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from ops.local.ports import free_port
from services.trainer.loop import RunResult, TrainerLoop, run
from shared import checkpoint
from shared.model import load_family
from shared.names import Topics
from shared.schemas import BatchManifest, BatchSkipped, WeightPublished
from shared.settings import KafkaSettings
from tests.support.kafka_io import produce
from tests.support.procs import REPO_ROOT, start_service
from tests.support.rebalance import ForeignMember
from tests.support.trainer_kafka import TrainerEnv, batch_manifest, check_checkpoints
from tests.support.wait import wait_until

pytestmark = [
    pytest.mark.integration,
]


@pytest.fixture
def env(
    kafka_bootstrap: str, unique_topic: Callable[..., str], unique_group: str, tmp_path: Path
) -> Iterator[TrainerEnv]:
    topics = Topics(groups=unique_topic(4), batches=unique_topic(4), weights=unique_topic(4))
    e = TrainerEnv(KafkaSettings(bootstrap_servers=kafka_bootstrap), topics, tmp_path, unique_group)
    yield e
    e.close()


def test_in_order_dedupe_and_restart_in_process(env: TrainerEnv) -> None:
    refs = env.groups(8)
    m = [batch_manifest(i, refs[2 * i : 2 * i + 2]) for i in range(4)]
    env.manifests([m[2], m[0], m[1], m[1], m[3]])  # out of order, index 1 published twice

    first = run(env.settings(max_steps=2))
    assert (first.start_step, first.step, first.trained_indices) == (0, 2, [0, 1])
    second = run(env.settings(max_steps=4))
    assert (second.start_step, second.step, second.trained_indices) == (2, 4, [2, 3])
    third = run(env.settings(max_steps=4))  # nothing left to do
    assert third.trained_indices == []

    lines = env.lines()
    assert [x["manifest_index"] for x in lines] == [0, 1, 2, 3]
    assert [x["step"] for x in lines] == [1, 2, 3, 4]
    # trained tokens are v1's: only step 2 ran on v1 (step 1 on v0, steps 3-4 on v2, v3)
    assert [x["same_version_tokens"] for x in lines] == [0, 2 * 4 * 4, 0, 0]
    assert [x["train_rollout_logprob_abs_diff_same_version"] is None for x in lines] == [True, False, True, True]
    for x in lines:
        assert x["masked_token_fraction"] == pytest.approx(0.5)
        assert x["reward_mean"] == pytest.approx(0.375)
        assert x["version_gap_mean"] == 0.5
        assert x["train_rollout_logprob_abs_diff"] > 0
        assert x["trained_tokens"] == 2 * 4 * 4
    check_checkpoints(env, env.published(5), 4)


def test_a_warm_start_takes_another_runs_checkpoint_as_its_step_0(env: TrainerEnv) -> None:
    """``init_weights``: a fresh run's ``v0`` is another run's trained step (the optimizer starts fresh), and
    a resume ignores it; a missing checkpoint is refused when the settings load."""
    env.manifests([batch_manifest(i, env.groups(2, start=2 * i)) for i in range(2)])
    run(env.settings(max_steps=2))
    warm = checkpoint.load(env.tmp / "weights" / "v2.pt")
    fresh = checkpoint.load(env.tmp / "weights" / "v0.pt")
    assert warm.digest != fresh.digest

    other = env.settings(max_steps=1, init_weights=env.tmp / "weights" / "v2.pt", consumer_group=f"{env.group}-warm",
                         weights_dir=env.tmp / "warm-weights", run_dir=env.tmp / "warm-run")
    assert run(other).trained_indices == [0]
    v0, v1 = (checkpoint.load(env.tmp / "warm-weights" / f"v{k}.pt") for k in (0, 1))
    assert (v0.version, v0.step, v0.digest) == ("v0", 0, warm.digest), "step 0 is the other run's v2, relabelled"
    assert v1.digest not in (warm.digest, fresh.digest)
    assert run(other.model_copy(update={"max_steps": 2})).start_step == 1, "a resume keeps its own step"

    with pytest.raises(ValueError, match="REIN_INIT_WEIGHTS"):
        env.settings(init_weights=env.tmp / "no-such.pt")


NO_SIGNAL = (0.5, 0.5, 0.5, 0.5)


def test_a_batch_without_signal_is_consumed_without_a_step_or_a_version(env: TrainerEnv) -> None:
    """Manifests whose groups all have equal rewards: no update, no step counted, no WeightPublished; their
    offsets are committed (the next run does not see them) and a BatchSkipped releases sync-mode runners,
    sent again at start when the run stopped right after one."""
    signal = env.groups(4)
    flat = env.groups(6, start=4, rewards=NO_SIGNAL)
    plan = [flat[0:2], signal[0:2], flat[2:4], flat[4:6], signal[2:4]]  # indices 0, 2, 3 carry no signal
    env.manifests([batch_manifest(i, refs) for i, refs in enumerate(plan)])
    stop = threading.Event()
    loop = TrainerLoop(env.settings(max_steps=2), stop)
    train = loop._train

    def train_until_3(manifest: BatchManifest, fetcher: object) -> bool:
        updated = train(manifest, fetcher)  # type: ignore[arg-type]
        if manifest.index == 3:
            stop.set()
        return updated

    loop._train = train_until_3  # type: ignore[method-assign]
    first = loop.run()
    assert (first.step, first.trained_indices, first.skipped_indices) == (1, [0, 1, 2, 3], [0, 2, 3])
    assert [e.seq for e in first.published] == [0, 1]
    lines = env.lines()
    assert [(x["manifest_index"], x["step"], x["skipped"]) for x in lines] == [
        (0, 0, "no_signal"), (1, 1, None), (2, 1, "no_signal"), (3, 1, "no_signal")]
    assert all(x["loss"] is None and x["grad_norm"] is None for x in lines if x["skipped"])
    sidecars = {p.name: json.loads(p.read_text()) for p in (env.tmp / "weights").glob("v*.json")}
    assert {k: v["last_index"] for k, v in sidecars.items()} == {"v0.json": 0, "v1.json": 3}

    second = run(env.settings(max_steps=2))  # the skipped manifests were committed: only index 4 is new
    assert (second.start_step, second.step, second.trained_indices) == (1, 2, [4])
    assert [x["manifest_index"] for x in env.lines()] == [0, 1, 2, 3, 4]
    records = env.weight_records()
    assert sorted(r.seq for r in records if isinstance(r, WeightPublished)) == [0, 1, 1, 2]  # v1 again at start
    # each version names the last manifest its weights consumed: what async pacing counts (v1 again at
    # start after the skips of 2 and 3, announced then by their BatchSkipped)
    assert sorted((r.seq, r.last_index) for r in records if isinstance(r, WeightPublished)) == [
        (0, -1), (1, 1), (1, 3), (2, 4)]
    skips = [(r.index, r.version) for r in records if isinstance(r, BatchSkipped)]
    assert skips == [(0, "v0"), (2, "v1"), (3, "v1"), (3, "v1")]  # and the skip of index 3
    check_checkpoints(env, env.published(3), 2)


def test_a_skip_between_publishes_is_made_durable_with_the_next_checkpoint(env: TrainerEnv) -> None:
    """publish_every=2: the skip of index 1 waits for step 2's checkpoint, whose version announces it."""
    signal = env.groups(6)
    flat = env.groups(2, start=6, rewards=NO_SIGNAL)
    env.manifests([batch_manifest(0, signal[0:2]), batch_manifest(1, flat), batch_manifest(2, signal[2:4])])
    result = run(env.settings(max_steps=2, publish_every=2))
    assert (result.step, result.trained_indices, result.skipped_indices) == (2, [0, 1, 2], [1])
    assert [e.seq for e in result.published] == [0, 2]
    assert [(x["step"], x["skipped"]) for x in env.lines()] == [(1, None), (1, "no_signal"), (2, None)]
    assert json.loads((env.tmp / "weights" / "v2.json").read_text())["last_index"] == 2
    assert not [r for r in env.weight_records() if isinstance(r, BatchSkipped)]
    env.manifests([batch_manifest(3, signal[4:6])])
    again = run(env.settings(max_steps=3, publish_every=2))  # 0..2 were committed with v2
    assert (again.start_step, again.trained_indices) == (2, [3])


def test_sigkill_mid_run_trains_each_manifest_once(env: TrainerEnv) -> None:
    refs = env.groups(12)
    manifests = [batch_manifest(i, refs[2 * i : 2 * i + 2]) for i in range(6)]
    env.manifests(manifests[:3])
    port = free_port()
    run_env = {
        "REIN_KAFKA__BOOTSTRAP_SERVERS": env.kafka.bootstrap_servers,
        "REIN_TOPICS__GROUPS": env.topics.groups,
        "REIN_TOPICS__BATCHES": env.topics.batches,
        "REIN_TOPICS__WEIGHTS": env.topics.weights,
        "REIN_WEIGHTS_DIR": str(env.tmp / "weights"),
        "REIN_RUN_DIR": str(env.tmp / "run"),
        "REIN_CONSUMER_GROUP": env.group,
        "REIN_METRICS_PORT": str(port),
        "REIN_MAX_STEPS": "6",
        "REIN_TORCH_THREADS": "1",
    }
    proc = start_service(
        "services.trainer", run_env, f"http://127.0.0.1:{port}/health", timeout_s=60, log_dir=env.tmp / "logs"
    )
    try:
        deadline = time.monotonic() + 60
        while len(env.lines()) < 2:  # wait for progress, then kill wherever it is
            assert proc.alive(), proc.tail()
            assert time.monotonic() < deadline, proc.tail()
            time.sleep(0.02)
        proc.process.kill()
        proc.process.wait(10)
    finally:
        proc.stop()
    env.manifests(manifests[3:])
    restarted = subprocess.run(
        [sys.executable, "-m", "services.trainer"],
        cwd=REPO_ROOT,
        timeout=120,
        capture_output=True,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("REIN_")}, **run_env},
    )
    assert restarted.returncode == 0, restarted.stderr.decode()[-3000:]
    lines = env.lines()
    assert [x["manifest_index"] for x in lines] == [0, 1, 2, 3, 4, 5]
    assert [x["step"] for x in lines] == [1, 2, 3, 4, 5, 6]
    check_checkpoints(env, env.published(7), 6)


def test_two_ranks_under_torchrun_train_the_weights_one_rank_trains(env: TrainerEnv) -> None:
    """``torchrun --nproc-per-node 2 -m services.trainer`` (gloo on loopback): rank 0 consumes, checkpoints
    and publishes as one trainer does, both ranks step on their shards, and the checkpoints equal those of
    one trainer on the same manifests (float summation order aside)."""
    refs = env.groups(6)
    env.manifests([batch_manifest(i, refs[2 * i : 2 * i + 2]) for i in range(3)])
    alone = run(env.settings(max_steps=3))
    assert alone.trained_indices == [0, 1, 2]
    ddp = env.tmp / "ddp"
    run_env = {
        "REIN_KAFKA__BOOTSTRAP_SERVERS": env.kafka.bootstrap_servers, "REIN_TOPICS__GROUPS": env.topics.groups,
        "REIN_TOPICS__BATCHES": env.topics.batches, "REIN_TOPICS__WEIGHTS": env.topics.weights,
        "REIN_WEIGHTS_DIR": str(ddp / "weights"), "REIN_RUN_DIR": str(ddp / "run"),
        "REIN_CONSUMER_GROUP": f"{env.group}-ddp", "REIN_METRICS_PORT": "0", "REIN_MAX_STEPS": "3",
        "REIN_TORCH_THREADS": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
         "services.trainer"],
        cwd=REPO_ROOT, timeout=240, capture_output=True, text=True,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("REIN_")}, **run_env},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert '"rank": 1' in proc.stdout + proc.stderr, "the second rank ran and followed"
    lines = [json.loads(x) for x in (ddp / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(x["manifest_index"], x["step"]) for x in lines] == [(0, 1), (1, 2), (2, 3)]
    for step in (1, 2, 3):
        one = checkpoint.load(env.tmp / "weights" / f"v{step}.pt").model.state_dict()
        two = checkpoint.load(ddp / "weights" / f"v{step}.pt").model.state_dict()
        for name, tensor in one.items():
            assert torch.allclose(tensor, two[name], atol=1e-5, rtol=0), (step, name)


def test_hf_model_trains_resumes_and_prunes_directory_checkpoints(env: TrainerEnv, tiny_llama_dir: Path) -> None:
    """REIN_MODEL=<HF directory>: same ordering and exactly-once machinery; checkpoints are HF directories."""
    family = load_family(str(tiny_llama_dir))
    refs = env.groups(6)
    env.manifests([batch_manifest(i, refs[2 * i : 2 * i + 2]) for i in range(3)])
    hf = {"model": str(tiny_llama_dir), "keep_checkpoints": 2, "gradient_checkpointing": True}

    first = run(env.settings(max_steps=2, **hf))
    assert (first.start_step, first.step, first.trained_indices) == (0, 2, [0, 1])
    second = run(env.settings(max_steps=3, **hf))  # resumes from the v2 directory and its AdamW state
    assert (second.start_step, second.step, second.trained_indices) == (2, 3, [2])

    lines = env.lines()
    assert [x["manifest_index"] for x in lines] == [0, 1, 2]
    assert all(x["trained_tokens"] == 2 * 4 * 4 and x["train_rollout_logprob_abs_diff"] > 0 for x in lines)
    events = env.published(4)
    assert [e.seq for e in events] == [0, 1, 2, 3]
    weights = env.tmp / "weights"
    assert sorted(p.name for p in weights.iterdir() if not p.name.startswith(".")) == [
        "v2", "v2.json", "v2.optim.pt", "v3", "v3.json", "v3.optim.pt"]
    for e in events[2:]:
        loaded = family.load(Path(e.path), torch.device("cpu"))
        assert Path(e.path).is_dir() and (loaded.digest, loaded.version, loaded.step) == (e.digest, e.version, e.step)
    assert events[3].digest != events[2].digest


def test_trainer_member_joins_and_leaves(env: TrainerEnv) -> None:
    """A foreign member joins the trainer's group mid-run, holds the next index, and leaves again:
    the trainer stays alive and trains every manifest once, in index order."""
    kafka_bootstrap, topics, unique_group = env.kafka.bootstrap_servers, env.topics, env.group
    refs = env.groups(16)
    manifests = [batch_manifest(i, refs[2 * i : 2 * i + 2]) for i in range(8)]
    env.manifests(manifests[:2])
    stop = threading.Event()
    results: list[RunResult] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            results.append(run(env.settings(max_steps=8, publish_every=1), stop))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=target, name="trainer-under-test", daemon=True)
    thread.start()
    try:
        wait_until(lambda: len(env.lines()) >= 2 or errors, 90, "the first two steps")
        with ForeignMember(kafka_bootstrap, unique_group, [topics.batches]) as member:
            theirs = sorted(p for _, p in member.partitions)
            ours = sorted(set(range(4)) - set(theirs))
            assert theirs and ours
            # index 2 on the member's partition, 3 and 4 on the trainer's: it buffers them and waits
            produce(kafka_bootstrap, topics.batches, manifests[2], theirs[0], keyed=False)
            for m in manifests[3:5]:
                produce(kafka_bootstrap, topics.batches, m, ours[0], keyed=False)
            wait_until(lambda: member.records > 0, 30, "the foreign member to read index 2")
            assert len(env.lines()) == 2 and not errors, "index 2 is held by the member: no step can follow"
        env.manifests(manifests[5:])
        thread.join(120)
        assert not thread.is_alive(), "the trainer did not finish its 8 steps"
    finally:
        stop.set()
        thread.join(30)
    assert not errors, errors
    [result] = results
    assert result.trained_indices == list(range(8))
    lines = env.lines()
    assert [x["manifest_index"] for x in lines] == list(range(8))
    assert [x["step"] for x in lines] == list(range(1, 9))


def test_stop_during_a_backlog_ends_after_the_current_step(env: TrainerEnv) -> None:
    """Eight manifests become ready in one offer (indices 1..7 first, then 0, on one partition); a stop
    that arrives during the first step ends the run after that step instead of training the backlog
    (with a real model that is minutes past a SIGTERM). The untrained seven are read again next run."""
    bootstrap = env.kafka.bootstrap_servers
    refs = env.groups(16)
    manifests = [batch_manifest(i, refs[2 * i : 2 * i + 2]) for i in range(8)]
    for m in [*manifests[1:], manifests[0]]:
        produce(bootstrap, env.topics.batches, m, 0, keyed=False)
    stop = threading.Event()
    loop = TrainerLoop(env.settings(max_steps=8, publish_every=1), stop)
    train = loop._train

    def train_then_stop(manifest: BatchManifest, fetcher: object) -> bool:
        updated = train(manifest, fetcher)  # type: ignore[arg-type]
        stop.set()  # as the SIGTERM handler does, while the backlog is still ready
        return updated

    loop._train = train_then_stop  # type: ignore[method-assign]
    first = loop.run()
    assert first.trained_indices == [0]
    assert [x["manifest_index"] for x in env.lines()] == [0]
    second = run(env.settings(max_steps=8, publish_every=1), threading.Event())
    assert second.trained_indices == list(range(1, 8))
    assert [x["step"] for x in env.lines()] == list(range(1, 9))
