"""The in-process reference's loop: the demo's pure parts wired together, one batch per :meth:`Reference.step`.

:class:`Recipe` says what a run trains with; :class:`Reference` plays episodes through the proxy's
transcript, the engine's batcher and the collector's assembler and window, and trains with the
trainer's step. ``bench/inprocess.py`` runs it and reads the reward curve.
"""

from __future__ import annotations

import copy
import itertools
import random
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ops.stack_flags import preset_stack
from services.collector.assembly import Assembler, Position
from services.engine.batcher import Batcher, Weights
from services.engine.sampling import SamplingParams
from services.proxy.transcript import SegmentState, Transcript
from services.rollout.settings import RolloutSettings
from services.rollout.task import Episode, Message, Prompt
from services.rollout.tasks import TASKS
from services.trainer.samples import build_samples
from services.trainer.settings import TrainerSettings
from services.trainer.step import PolicyTrainer
from shared.model import load_family
from shared.model.compute import context_window_of
from shared.schemas import Chunk, CompletedGroup, GroupDispatched, SessionFinished
from shared.staleness import Batch, Decision, NoSignalGroups, WindowSettings
from shared.tokenizer import TOKENIZER
from shared.window_rule import WindowReplay
from shared.window_view import window_group


@dataclass
class _Session(Transcript):
    """One episode's transcript, as the proxy keeps it (the mixin's two fields)."""

    segments: list[SegmentState] = field(default_factory=list)
    num_chunks: int = 0


@dataclass
class _Live:
    session_id: str
    group_id: str
    episode: Episode
    messages: list[Message]
    transcript: _Session = field(default_factory=_Session)
    turn: int = 0
    ready_at: float = 0.0
    """When its next call reaches the engine (the asynchronous schedule's clock, in mean turn times)."""


DEMO = preset_stack("tiny")
"""The stack ``make demo`` starts on the tiny policy: what the in-process loop plays unless a recipe says otherwise."""


@dataclass(frozen=True)
class Recipe:
    """What one in-process run trains with: the batch's shape, the trainer's settings and the schedule.

    The default is the demo's (``tiny`` preset: its batch and policy width, the trainer's other defaults,
    synchronous, every group trained). ``in_flight`` > 0 plays the pipeline's asynchronous schedule instead (below)."""

    batch_groups: int = DEMO.batch_groups
    group_size: int = DEMO.setting("rollout", "group_size")
    trainer: tuple[tuple[str, Any], ...] = ()
    """:class:`TrainerSettings` fields set over their defaults (``lr``, ``entropy_coef``, ...)."""
    no_signal: str = "keep"
    """``keep``: a group whose rewards are all equal fills a batch slot (the trainer's sync default);
    ``drop``: it is dropped and more groups are played until the batch holds ``batch_groups`` with signal
    (the collector in async mode, ``REIN_NO_SIGNAL_GROUPS``)."""
    lag: int = 0
    """Sample with the weights ``lag`` updates older than the trainer's (a fixed policy lag)."""
    in_flight: int = 0
    """0: synchronous (play a batch, train, serve). N > 0: the pipeline's schedule, on a clock in mean turn
    times: up to N groups in flight (and at most ``keep_versions`` x ``batch_groups`` started and not yet
    trained or dropped, counting batches whose weights are not served yet: the runner's pacing); each turn
    of an episode takes a time drawn uniformly from 1 ± ``jitter``, so episodes drift apart as they do
    behind HTTP; the engine decodes together the calls that arrive within 0.1 of each other; each batch is
    trained as soon as the window holds it and its weights are served ``update_delay`` later (the trainer's
    step and the broadcast), from the next call on, so an episode's later turns may come from newer
    weights than its first."""
    jitter: float = 0.9
    update_delay: float = 0.0
    """Defaults: with the demo's 16 groups in flight, 8 per batch and keep 2, they give the demo's share of
    masked tokens (~20 %, docs/benchmarks.md "Learning per episode, in process")."""
    keep_versions: int = 2
    """The collector's window when ``in_flight`` > 0 (its rule, ``shared.window_rule.window_step``: a group
    with a trajectory whose last trained token is older than the newest version seen - keep + 1 is dropped,
    pending groups too when the window advances); 0: no window."""

    def settings(self) -> TrainerSettings:
        """The trainer's settings: the preset's policy width (as ``make demo`` gives its trainer), then ``trainer``."""
        return TrainerSettings(**{"model_width": DEMO.setting("trainer", "model_width"), **dict(self.trainer)})

    def describe(self) -> dict[str, Any]:
        schedule = ({"keep_versions": self.keep_versions, "jitter": self.jitter, "update_delay": self.update_delay}
                    if self.in_flight else {})
        return {"batch_groups": self.batch_groups, "group_size": self.group_size, "trainer": dict(self.trainer),
                "model_width": self.settings().model_width, "no_signal": self.no_signal, "lag": self.lag,
                "in_flight": self.in_flight, **schedule}


def _index_of(label: str) -> int:
    return int(label[1:])


class Reference:
    """The demo's loop in one process; :meth:`step` plays until one batch is trained (or skipped)."""

    def __init__(self, seed: int = 0, threads: int = 1, recipe: Recipe | None = None) -> None:
        self.recipe = recipe = recipe or Recipe()
        torch.set_num_threads(threads)
        self.trainer_settings = recipe.settings()
        self.rollout_settings = RolloutSettings()
        s = self.trainer_settings
        self.batch_groups, self.group_size = recipe.batch_groups, recipe.group_size
        self.family = load_family("tiny", tiny_config=s.tiny_policy(TOKENIZER.vocab_size))
        self.tokenizer = self.family.tokenizer
        device = torch.device("cpu")
        model = self.family.new_model(seed, device, dtype=torch.float32)
        self.trainer = PolicyTrainer(model, s, device)
        self.context = context_window_of(self.family, model)
        self._served: deque[Weights] = deque([self._serve(0)], maxlen=recipe.lag + 1)
        self.batcher = Batcher(self._served[0], end_id=self.tokenizer.stop_ids, pad_id=self.tokenizer.pad_id,
                               seed=seed, device=device)
        self.task = TASKS[DEMO.setting("rollout", "task")]()
        self.prompts: Iterator[Prompt] = self.task.prompts(seed)
        self.assembler = Assembler()
        self.params = SamplingParams(max_new_tokens=DEMO.setting("rollout", "max_tokens"),
                                     temperature=self.rollout_settings.temperature)
        self.window = WindowReplay(WindowSettings(
            keep_versions=recipe.keep_versions if recipe.in_flight else 0, batch_groups=recipe.batch_groups,
            no_signal_groups=NoSignalGroups(recipe.no_signal)), _index_of)
        self.step_no = 0
        self.live: list[_Live] = []
        self.playing: set[str] = set()
        """Groups started and not yet complete."""
        self.completed: dict[str, CompletedGroup] = {}
        """Complete groups the window holds (pending a batch)."""
        self.batches: deque[Batch] = deque()
        self.played = 0
        """Episodes of complete groups (trained, dropped or pending)."""
        self.tally: dict[str, float] = {"reward": 0.0, "episodes": 0, "dropped_stale": 0, "dropped_no_signal": 0}
        """Since the last step: the reward of the episodes that ended and the groups the window dropped."""
        self._offsets = itertools.count()
        self._ids = itertools.count()
        self.now = 0.0
        self._clock = random.Random(seed)
        self._swaps: deque[tuple[float, Weights, int]] = deque()
        """Weights trained and not yet served: (when, weights, groups of the batches they consumed)."""

    def _serve(self, step: int) -> Weights:
        """The trainer's weights as the engine would load them (a copy, so training never touches them)."""
        model = copy.deepcopy(self.trainer.model).eval()
        for p in model.parameters():
            p.grad = None
        return Weights(model=model, version=f"v{step}", digest="", step=step, model_path=None)

    def _add(self, record: Chunk | GroupDispatched | SessionFinished) -> CompletedGroup | None:
        return self.assembler.add(Position("inprocess", 0, next(self._offsets)), record)

    def _capacity(self) -> int:
        """Most groups started and not yet trained or dropped (playing + pending)."""
        r = self.recipe
        if not r.in_flight:
            return r.batch_groups
        return min(r.in_flight, r.keep_versions * r.batch_groups) if r.keep_versions else r.in_flight

    def _start_groups(self) -> None:
        unserved = sum(n for _, _, n in self._swaps)
        while len(self.playing) + len(self.window.state.pending) + unserved < self._capacity():
            prompt = next(self.prompts)
            group_id = f"g{next(self._ids)}"
            sessions = [f"{group_id}-s{i}" for i in range(self.group_size)]
            self._add(GroupDispatched(group_id=group_id, prompt_id=prompt.prompt_id, session_ids=sessions,
                                      prompt=prompt.payload))
            self.playing.add(group_id)
            for sid in sessions:
                episode = self.task.episode()
                self.live.append(_Live(sid, group_id, episode, episode.reset(dict(prompt.payload)), ready_at=self.now))

    def _round(self) -> None:
        """Synchronous: every live episode plays one turn (one batched decode). Asynchronous: the clock moves
        to the next call, weights due by then are served, and the calls due within 0.1 play one turn.
        Complete groups go to the window."""
        r = self.recipe
        if r.in_flight:
            events = [ep.ready_at for ep in self.live]
            if self._swaps:
                events.append(self._swaps[0][0])
            self.now = max(self.now, min(events)) if events else self.now
            while self._swaps and self._swaps[0][0] <= self.now:
                self.batcher.swap_weights(self._swaps.popleft()[1])
        self._start_groups()
        due = [ep for ep in self.live if ep.ready_at <= self.now + 0.1] if r.in_flight else self.live
        waiting = [ep for ep in self.live if ep.ready_at > self.now + 0.1] if r.in_flight else []
        calls = []
        for ep in due:
            plan = ep.transcript.plan(ep.messages, self.tokenizer)
            request = self.batcher.admit(f"{ep.session_id}-t{ep.turn}", plan.prompt_ids, self.params)
            calls.append((ep, plan, request))
        while self.batcher.has_work():
            self.batcher.step()
        still: list[_Live] = []
        for ep, plan, req in calls:
            assert req.finish_type is not None
            seq = ep.transcript.record_chunk(plan, plan.context_ids, req.output_ids, req.versions)
            self._add(Chunk(session_id=ep.session_id, group_id=ep.group_id, seq=seq,
                            segment_index=plan.segment_index, chunk_index=0, context_ids=list(plan.context_ids),
                            output_ids=req.output_ids, logprobs=req.logprobs, version=req.weight_version,
                            finish_reason=req.finish_type, rid=req.rid))
            ep.turn += 1
            text = self.tokenizer.decode(req.output_ids)
            ep.messages.append({"role": "assistant", "content": text})
            feedback = ep.episode.step(text)
            if feedback is not None:
                ep.messages.extend(feedback)
                ep.ready_at = self.now + self._clock.uniform(1 - r.jitter, 1 + r.jitter)
                still.append(ep)
                continue
            group = self._add(SessionFinished(session_id=ep.session_id, group_id=ep.group_id,
                                              reward=ep.episode.reward(), status=ep.episode.status,
                                              num_chunks=ep.transcript.num_chunks))
            if group is not None:
                self.assembler.release(group.group_id)
                self._complete(group)
        self.live = waiting + still
        self.assembler.take_done()

    def _complete(self, group: CompletedGroup) -> None:
        self.playing.discard(group.group_id)
        self.played += len(group.trajectories)
        self.tally["episodes"] += len(group.trajectories)
        self.tally["reward"] += sum(t.reward for t in group.trajectories)
        self.completed[group.group_id] = group
        result = self.window.feed(window_group(group))
        for d in result.decisions:
            if d.decision is not Decision.KEPT:
                self.completed.pop(d.group_id, None)
                cause = "dropped_no_signal" if d.decision is Decision.DROPPED_NO_SIGNAL else "dropped_stale"
                self.tally[cause] += 1
        if result.batch is not None:
            self.batches.append(result.batch)

    def step(self) -> dict[str, Any]:
        """Play rounds until the window holds a batch, then the trainer's step on it; the weights it leaves
        are served from the next round (``lag`` updates later with a lag; unchanged after a batch the trainer
        skipped)."""
        while not self.batches:
            self._round()
        batch = self.batches.popleft()
        groups = [self.completed.pop(g.group_id) for g in batch.groups]
        samples = build_samples(groups, mask_nonlast_version=self.trainer_settings.nonlast_version_tokens == "mask",
                                max_tokens=self.context)
        stats = self.trainer.step(samples, version=f"v{self.step_no}")
        if stats.updated:  # as the trainer does: a batch without gradient leaves weights and version alone
            self.step_no += 1
            self._served.append(self._serve(self.step_no))
            if self.recipe.in_flight:
                self._swaps.append((self.now + self.recipe.update_delay, self._served[0], len(groups)))
            else:
                self.batcher.swap_weights(self._served[0])
        rewards = samples.rewards
        tally, self.tally = self.tally, {k: 0.0 if k == "reward" else 0 for k in self.tally}
        return {"step": self.step_no, "trajectories": len(rewards),
                "reward_mean": sum(rewards) / len(rewards) if rewards else None,
                "episodes": self.played, "played": tally["episodes"], "played_reward_sum": tally["reward"],
                "dropped_stale": tally["dropped_stale"], "dropped_no_signal": tally["dropped_no_signal"],
                "trainable_tokens": samples.trainable_tokens, "masked_tokens": samples.version_masked_tokens,
                "version_gap_mean": batch.gap.mean if batch.gap else None,
                "trained_tokens": stats.trained_tokens, "loss": stats.loss, "skipped": stats.skipped,
                "entropy": stats.entropy}
