"""The trainer's main loop: the only place in the trainer with I/O.

Consumes ``train.batches`` (manifests, consumer group ``consumer_group``, manual
commit) and ``rollout.groups`` (by reference); produces checkpoints in
``weights_dir``, ``WeightPublished`` events on ``weights`` (key = version),
``BatchSkipped`` there for batches consumed without an update, and
``run_dir/metrics.jsonl``. Owns the policy and its optimizer; the model family
(``REIN_MODEL``: tiny or a Hugging Face model) builds, saves and loads it.

Lifecycle:

- start: resume from the newest durable checkpoint (see ``store``), or write
  ``v0`` from the family's initial weights (tiny: from ``seed``; HF: the
  pretrained ones; ``init_weights``: a checkpoint, a warm start); re-publish that checkpoint's event
  (idempotent by key: covers a crash between sidecar and publish); restore any
  metrics line a crash lost.
- each manifest, in index order from ``last_index + 1`` (duplicates and indices
  already trained are dropped and their offsets committed): fetch its groups →
  samples → one optimizer step, or none when the batch carries no gradient (every
  trained token's advantage is 0, or the gradient is): the weights, the optimizer
  state and the step count stay as they were, and no version is published for it.
- every ``publish_every`` steps (and at ``max_steps`` or on stop): checkpoint →
  sidecar → metrics lines → publish → commit the manifests' offsets. A crash
  before the sidecar retrains those manifests from the previous checkpoint; a
  crash after it skips them by index. No manifest is trained twice into the
  published weights, none is skipped.
- a skipped manifest with no step pending since the last checkpoint is made durable
  at once without one: the sidecar alone moves its ``last_index`` on (``store.advance``),
  then metrics line → ``BatchSkipped`` on ``weights`` (a sync-mode runner waits for a
  version otherwise) → commit. One with steps pending waits for their checkpoint.

Under ``torchrun`` (``services/trainer/parallel.py``, docs/scaling.md) this loop is rank 0's; the other
ranks load the same checkpoint and step on their shard of every batch rank 0 hands them.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from services.trainer.fetch import Fetched, FetchTimeout, GroupFetcher
from services.trainer.metrics import TrainerMetrics, step_line
from services.trainer.ordering import ManifestOrder
from services.trainer.parallel import ALONE, Ranks
from services.trainer.samples import build_samples
from services.trainer.settings import TrainerSettings
from services.trainer.step import PolicyTrainer
from services.trainer.store import (
    MetricsLog,
    Sidecar,
    advance,
    latest,
    prune,
    reconcile_metrics,
    save_step,
    version_label,
)
from shared import log
from shared.bus import BusUnavailable, Consumer, Producer
from shared.codec import DecodeError
from shared.model import ModelFamily, load_family
from shared.model.compute import context_window_of, set_gradient_checkpointing
from shared.outage import Outage
from shared.policy import resolve_device
from shared.schemas import BatchManifest, BatchSkipped, WeightPublished
from shared.status_server import StatusServer
from shared.tokenizer import TOKENIZER

_log = log.get(__name__)


@dataclass
class RunResult:
    """What one :func:`run` did (tests and the demo read it)."""

    start_step: int
    step: int
    trained_indices: list[int] = field(default_factory=list)
    """Manifests consumed, in order (skipped ones too)."""
    skipped_indices: list[int] = field(default_factory=list)
    """Those consumed without an update (no gradient)."""
    published: list[WeightPublished] = field(default_factory=list)


class TrainerLoop:
    """Wires consumer → order → fetch → samples → step → store → publish → commit."""

    def __init__(self, settings: TrainerSettings, stop: threading.Event | None = None, ranks: Ranks = ALONE) -> None:
        self.settings = settings
        self.stop = stop or threading.Event()
        self.ranks = ranks
        """Data-parallel ranks (``services/trainer/parallel.py``): rank 0 runs this loop, the others follow it."""
        self.metrics = TrainerMetrics(CollectorRegistry(auto_describe=True))
        self.device = resolve_device(settings.device)
        self.family: ModelFamily = load_family(settings.model, tiny_config=settings.tiny_policy(TOKENIZER.vocab_size))
        self.metrics_log = MetricsLog(settings.run_dir / "metrics.jsonl")
        self._held: dict[int, list[tuple[str, int, int]]] = {}
        """Manifest index -> positions of every record carrying it (duplicates too), done once it is durable."""
        self._last_trained = -1
        self._pending_lines: list[dict[str, Any]] = []
        self._last_poll = time.monotonic()
        self.port: int | None = None

    # ------------------------------------------------------------------ lifecycle

    def _autocast(self) -> torch.dtype | None:
        precision = self.settings.precision
        if precision == "auto":
            precision = "bf16" if self.family.kind == "hf" and self.device.type == "cuda" else "fp32"
        return torch.bfloat16 if precision == "bf16" else None

    def _new_trainer(self, model: torch.nn.Module) -> PolicyTrainer:
        s = self.settings
        if s.gradient_checkpointing and not set_gradient_checkpointing(model, True):
            _log.warning("gradient_checkpointing_unsupported", model=self.family.name)
        return PolicyTrainer(model, s, self.device, autocast=self._autocast(), ranks=self.ranks)

    def _restore(self) -> tuple[PolicyTrainer, Sidecar]:
        s = self.settings
        fp32 = torch.float32  # master weights; the forward may autocast
        resumed = latest(s.weights_dir, self.family, self.device, dtype=fp32)
        if resumed is not None:
            trainer = self._new_trainer(resumed.checkpoint.model)
            if resumed.optimizer_state is not None:
                trainer.load_optimizer_state(resumed.optimizer_state)
            restored = reconcile_metrics(self.metrics_log, resumed.sidecar)
            _log.info("trainer_resumed", step=resumed.sidecar.step, last_index=resumed.sidecar.last_index,
                      digest=resumed.sidecar.digest, metrics_lines_restored=restored, model=self.family.name)
            return trainer, resumed.sidecar
        if s.init_weights is None:
            model = self.family.new_model(s.seed, self.device, dtype=fp32)
        else:
            model = self.family.load(s.init_weights, self.device, dtype=fp32).model
        trainer = self._new_trainer(model)
        sidecar = save_step(s.weights_dir, self.family, trainer.model, 0, s.first_index - 1,
                            trainer.optimizer_state())
        _log.info("trainer_initialised", step=0, path=sidecar.path, digest=sidecar.digest, model=self.family.name,
                  params=sum(p.numel() for p in model.parameters()),
                  init_weights=None if s.init_weights is None else str(s.init_weights))
        return trainer, sidecar

    def _health(self) -> tuple[bool, dict[str, object]]:
        stalled = time.monotonic() - self._last_poll > max(60.0, 10 * self.settings.poll_timeout_s)
        return not stalled, {"status": "stalled" if stalled else "ok", "step": self.step}

    def run(self) -> RunResult:
        s = self.settings
        torch.set_num_threads(s.torch_threads)
        if self.ranks.rank != 0:
            return self._follow()
        trainer, sidecar = self._restore()
        self.ranks.barrier()  # the newest checkpoint is on disk: the other ranks load it
        try:
            return self._lead(trainer, sidecar)
        finally:
            self.ranks.broadcast(None)  # the other ranks stop (no-op alone)

    def _follow(self) -> RunResult:
        """A rank other than 0: load the checkpoint rank 0 resumed from, then step on each batch it broadcasts
        until it broadcasts None. SIGTERM is rank 0's to act on: a follower stops when rank 0 does."""
        self.ranks.barrier()
        resumed = latest(self.settings.weights_dir, self.family, self.device, dtype=torch.float32)
        assert resumed is not None, "rank 0 writes a checkpoint before the barrier"
        trainer = self._new_trainer(resumed.checkpoint.model)
        if resumed.optimizer_state is not None:
            trainer.load_optimizer_state(resumed.optimizer_state)
        step = resumed.sidecar.step
        _log.info("trainer_rank_following", rank=self.ranks.rank, world=self.ranks.world, step=step)
        while (message := self.ranks.broadcast(None)) is not None:
            batch, version = message
            if trainer.step(batch, version=version).updated:
                step += 1
        return RunResult(start_step=resumed.sidecar.step, step=step)

    def _lead(self, trainer: PolicyTrainer, sidecar: Sidecar) -> RunResult:
        s = self.settings
        self.trainer, self.sidecar = trainer, sidecar
        self.max_tokens = context_window_of(self.family, trainer.model)
        self.step = sidecar.step
        result = RunResult(start_step=sidecar.step, step=sidecar.step)
        producer = Producer(s.kafka, client_suffix="trainer")
        try:
            result.published.append(self._publish(producer, sidecar))
            if (skip := _last_skip(sidecar)) is not None:  # a crash may have come before it was sent
                self._send(producer, skip)
            if s.max_steps and self.step >= s.max_steps:
                return result
            server = StatusServer(s.metrics_host, s.metrics_port, self.metrics.registry, self._health).start()
            self.port = server.port
            consumer = Consumer(
                s.kafka, [s.topics.batches], s.consumer_group, client_suffix="trainer",
                on_decode_error=lambda topic, _p, _o, exc: self.metrics.decode_errors.inc(
                    topic, exc.reason if isinstance(exc, DecodeError) else "unknown"),
            )
            fetcher = GroupFetcher(s.kafka, s.topics.groups)
            try:
                self._consume(consumer, fetcher, producer, result)
            finally:
                fetcher.close()
                consumer.close()
                server.stop()
        finally:
            producer.close()
        result.step = self.step
        return result

    # ------------------------------------------------------------------ consuming

    def _consume(self, consumer: Consumer, fetcher: GroupFetcher, producer: Producer, result: RunResult) -> None:
        s = self.settings
        order: ManifestOrder[BatchManifest] = ManifestOrder(next_index=self.sidecar.last_index + 1)
        self._last_trained = self.sidecar.last_index
        self.metrics.waiting_for.set(order.next_index)
        done = False
        while not done and not self.stop.is_set():
            polled = consumer.poll(s.poll_timeout_s)
            self._last_poll = time.monotonic()
            for rec in polled:
                if not isinstance(rec.record, BatchManifest):
                    _log.warning("unexpected_record", topic=rec.topic, type=rec.record.type)
                    consumer.done(rec.topic, rec.partition, rec.offset)
                    continue
                index = rec.record.index
                if index <= self.sidecar.last_index:  # already in a durable checkpoint
                    consumer.done(rec.topic, rec.partition, rec.offset)
                else:  # done with the index it carries, once that index is durable
                    self._held.setdefault(index, []).append((rec.topic, rec.partition, rec.offset))
                offered = order.offer(index, rec.record)
                if offered.duplicate:
                    self.metrics.duplicates.inc()
                    _log.info("manifest_duplicate", index=index, next_index=order.next_index)
                for _, manifest in offered.ready:
                    if done or self.stop.is_set():
                        break  # not trained, so never durable: read again next run (a backlog
                        # of ready manifests must not hold a SIGTERM for minutes with a real model)
                    updated = self._train(manifest, fetcher)
                    self._last_trained = manifest.index
                    result.trained_indices.append(manifest.index)
                    if not updated:
                        result.skipped_indices.append(manifest.index)
                    due = self.step % s.publish_every == 0 or (s.max_steps and self.step >= s.max_steps)
                    if (updated and due) or self.step == self.sidecar.step:
                        self._durable(producer, consumer, result)
                    done = bool(s.max_steps and self.step >= s.max_steps)
                if done:
                    break
            self.metrics.buffered.set(order.buffered)
            self.metrics.waiting_for.set(order.next_index)
            consumer.commit()
        if self._last_trained > self.sidecar.last_index:  # stopped between publishes: keep what was trained
            self._durable(producer, consumer, result)

    def _durable(self, producer: Producer, consumer: Consumer, result: RunResult) -> None:
        if (event := self._make_durable(producer, consumer)) is not None:
            result.published.append(event)

    def _train(self, manifest: BatchManifest, fetcher: GroupFetcher) -> bool:
        """Fetch, build and step on ``manifest``; True when the weights were updated (the step counts)."""
        s = self.settings
        started = time.monotonic()
        fetched = self._fetch(fetcher, manifest)
        fetch_time = time.monotonic() - started
        if fetched.bad:
            self.metrics.bad_refs.inc(len(fetched.bad))
        withheld = {sid for ref in manifest.groups for sid in ref.withheld}
        batch = build_samples(fetched.groups, mask_nonlast_version=s.nonlast_version_tokens == "mask",
                              max_tokens=self.max_tokens, withheld=withheld)
        version = version_label(self.step)  # the weights held: v<steps so far>
        if self.ranks.world > 1:
            self.ranks.broadcast((batch, version))  # every rank steps on its shard of it
        stats = self.trainer.step(batch, version=version)
        if stats.updated:
            self.step += 1
        line = step_line(step=self.step, manifest=manifest, batch=batch, stats=stats, bad_refs=len(fetched.bad),
                         step_time_s=time.monotonic() - started, fetch_time_s=fetch_time,
                         correction=s.offpolicy_correction)
        self._pending_lines.append(line)
        self.metrics.observe(line)
        if not stats.updated:
            _log.info("step_skipped", reason=stats.skipped, step=self.step, manifest_index=manifest.index,
                      reward_mean=line["reward_mean"], trained_tokens=stats.trained_tokens,
                      degenerate_group_fraction=line["degenerate_group_fraction"], grad_norm=stats.grad_norm)
            return False
        _log.info("trained", step=self.step, manifest_index=manifest.index, loss=stats.loss,
                  reward_mean=line["reward_mean"], abs_diff=stats.train_rollout_logprob_abs_diff,
                  abs_diff_same_version=stats.train_rollout_logprob_abs_diff_same_version,
                  same_version_tokens=stats.same_version_tokens,
                  masked_token_fraction=round(batch.masked_token_fraction, 4), version_gap=line["version_gap_mean"])
        return True

    def _fetch(self, fetcher: GroupFetcher, manifest: BatchManifest) -> Fetched:
        """The manifest's groups; a fetch that times out (the broker restarting) is tried again, bounded."""
        s = self.settings
        attempt = 1
        while True:
            try:
                return fetcher.fetch(list(manifest.groups), s.fetch_timeout_s)
            except FetchTimeout as exc:
                if attempt >= s.fetch_attempts or self.stop.is_set():
                    raise
                _log.warning("fetch_retry", manifest_index=manifest.index, attempt=attempt, error=str(exc)[:300])
                attempt += 1

    def _make_durable(self, producer: Producer, consumer: Consumer) -> WeightPublished | None:
        """Make every manifest consumed so far durable, then commit their offsets. With a step since the
        last checkpoint: a new checkpoint and its version (returned). With only skipped batches: the
        sidecar moves on and a ``BatchSkipped`` goes out instead (None returned)."""
        last_index = self._last_trained
        s = self.settings
        event: WeightPublished | None = None
        if self.step > self.sidecar.step:
            self.sidecar = save_step(s.weights_dir, self.family, self.trainer.model, self.step, last_index,
                                     self.trainer.optimizer_state(), self._pending_lines)
            self.metrics_log.append(self._pending_lines)
            event = self._publish(producer, self.sidecar)
        else:
            self.sidecar = advance(s.weights_dir, self.sidecar, last_index, self._pending_lines)
            self.metrics_log.append(self._pending_lines)
            if (skip := _last_skip(self.sidecar)) is not None:
                self._send(producer, skip)
        for index in [i for i in self._held if i <= last_index]:
            for topic, partition, offset in self._held.pop(index):
                consumer.done(topic, partition, offset)
        self._pending_lines = []
        consumer.commit()
        if dropped := prune(s.weights_dir, self.family, s.keep_checkpoints):
            _log.info("checkpoints_pruned", steps=dropped)
        return event

    def _publish(self, producer: Producer, sidecar: Sidecar) -> WeightPublished:
        event = WeightPublished(version=sidecar.version, seq=sidecar.step, path=sidecar.path, digest=sidecar.digest,
                                step=sidecar.step, last_index=sidecar.last_index)
        self._send(producer, event)
        self.metrics.published.inc()
        _log.info("weights_published", version=event.version, seq=event.seq, digest=event.digest, path=event.path)
        return event

    def _send(self, producer: Producer, record: WeightPublished | BatchSkipped) -> None:
        outage: Outage | None = None
        while True:  # what it announces is durable; the record must follow, so wait out a Kafka outage
            try:
                producer.send(self.settings.topics.weights, record)
                break
            except BusUnavailable as exc:
                if self.stop.is_set():
                    raise
                outage = outage or Outage(_log)
                self.stop.wait(outage.failed(exc))
        if outage is not None:
            outage.recovered()


def _last_skip(sidecar: Sidecar) -> BatchSkipped | None:
    """The ``BatchSkipped`` to announce for a sidecar that only skipped batches made durable (``advance``);
    None for one that came with a checkpoint (its version is the announcement)."""
    lines = sidecar.metrics
    if not lines or not all(line.get("skipped") for line in lines):
        return None
    last = lines[-1]
    return BatchSkipped(index=sidecar.last_index, batch_id=str(last["batch_id"]), reason=str(last["skipped"]),
                        version=sidecar.version)


def run(settings: TrainerSettings, stop: threading.Event | None = None, ranks: Ranks = ALONE) -> RunResult:
    """Build the loop and run it until ``max_steps`` or ``stop`` is set (rank 0; the other ranks follow it)."""
    return TrainerLoop(settings, stop, ranks).run()
