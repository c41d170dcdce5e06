"""Record types of every Kafka topic (their msgpack wire form is :mod:`shared.codec`).

A record is where a version label enters its consumers: every version field is
normalised on construction and decode (``Label``, ``RealLabel``), so a record from any
producer carries real labels or None and the rules downstream take them as they are.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shared.versions import Label, RealLabel, decode_runs


def _now() -> float:
    return time.time()


_ID_BITS = random.Random()
"""This process's own generator, seeded from ``os.urandom``: ids must be unique, not secret, and a
``getrandom`` syscall per id (``uuid4``) showed in the proxy's profile (two ids per chat call). Seeded again
in a forked child (a warm start, ``ops/local/warm.py``), which would otherwise repeat its parent's ids."""
os.register_at_fork(after_in_child=_ID_BITS.seed)


def new_id(prefix: str) -> str:
    """A fresh id: ``prefix``, a dash and 32 random hex digits; ids are never prefixes of each other
    (SGLang matches rids by prefix)."""
    return f"{prefix}-{_ID_BITS.getrandbits(128):032x}"


class Record(BaseModel):
    """Base of every record: typed, frozen, unknown fields rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    type: str
    ts: float = Field(default_factory=_now)
    """Wall-clock time the record was made (per record, never one import-time value)."""

    topic_attr: ClassVar[str] = ""
    """Attribute of :class:`shared.names.Topics` naming the topic this record goes to."""

    def key(self) -> str:
        raise NotImplementedError


# --------------------------------------------------------------------------- rollout.chunks


class SamplingParams(BaseModel):
    """How a chunk's tokens were sampled (:mod:`shared.model.sampling`): the behaviour policy is the
    model under these parameters, so the trainer scores the tokens with them. ``temperature`` 0 is
    greedy (its tokens carry no gradient and are not trained); ``top_k`` <= 0 and ``top_p`` 1 keep
    the whole vocabulary."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    temperature: float = Field(default=1.0, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = -1


class Chunk(Record):
    """One engine generation call of a session (a resumed generation has several chunks).

    ``context_ids`` are the tokens appended to the session's sequence before this
    chunk's output (new messages and the assistant header); empty for a chunk that
    continues a preempted generation. Concatenating ``context_ids + output_ids`` of
    a segment's chunks in ``seq`` order rebuilds the segment exactly.
    """

    topic_attr: ClassVar[str] = "chunks"
    type: Literal["chunk"] = "chunk"
    session_id: str
    group_id: str
    prompt_id: str = ""
    attempt: int = Field(default=0, ge=0)
    turn_id: str = ""
    seq: int = Field(ge=0)
    """Position of this chunk in the session (0, 1, 2, ...); the collector orders by it."""
    segment_index: int = Field(ge=0)
    chunk_index: int = Field(ge=0)
    """Position inside one chat call (0 for the first engine request of the call)."""
    context_ids: list[int] = Field(default_factory=list)
    output_ids: list[int] = Field(default_factory=list)
    logprobs: list[float] = Field(default_factory=list)
    version: Label = None
    """Normalised ``weight_version`` the engine reported for the call (its version when it answered)."""
    token_versions: list[tuple[Label, int]] = Field(default_factory=list)
    """The version of each output token as the engine reported it, run-length encoded
    (``[(label, count), ...]``, counts summing to ``len(output_ids)``): an engine may swap
    weights mid-request. Empty: every output token carries ``version``."""
    finish_reason: Literal["stop", "length", "abort"]
    rid: str = ""
    engine: str = ""
    sampling: SamplingParams | None = None
    """The sampling parameters of the engine call (None: not recorded; the trainer assumes its
    ``REIN_TEMPERATURE`` and no filtering, as before this field existed)."""
    forced_ids: list[int] = Field(default_factory=list)
    """The tail of ``context_ids`` the proxy forced after the generation prompt, not the engine (the opener of
    a tool call that ``tool_choice`` asked for): context like the rest of it, never trained."""

    @model_validator(mode="after")
    def _runs_cover_the_output(self) -> Chunk:
        if self.token_versions:
            total = sum(count for _, count in self.token_versions)
            if total != len(self.output_ids) or any(count < 1 for _, count in self.token_versions):
                raise ValueError(
                    f"token_versions cover {total} tokens in runs of at least 1, output_ids has {len(self.output_ids)}"
                )
        return self

    def output_versions(self) -> list[str | None]:
        """The version of every output token."""
        if self.token_versions:
            return decode_runs(self.token_versions)
        return [self.version] * len(self.output_ids)

    def key(self) -> str:
        return self.group_id


# --------------------------------------------------------------------------- rollout.events


class GroupDispatched(Record):
    """The rollout runner started ``group_size`` sessions of one prompt (attempt 0, 1, ...)."""

    topic_attr: ClassVar[str] = "events"
    type: Literal["group_dispatched"] = "group_dispatched"
    group_id: str
    prompt_id: str
    attempt: int = Field(default=0, ge=0)
    """Failed attempts of this prompt so far that counted toward ``max_retries``."""
    free_retries: int = Field(default=0, ge=0)
    """Retries of this prompt so far that did not count (a dependency's failure, not the prompt's)."""
    session_ids: list[str] = Field(min_length=1)
    prompt: dict[str, Any] = Field(default_factory=dict)
    """The task's prompt payload, so a retry can be dispatched from the record alone."""

    def key(self) -> str:
        return self.group_id


class SessionFinished(Record):
    """The agent finished a session and reported its reward."""

    topic_attr: ClassVar[str] = "events"
    type: Literal["session_finished"] = "session_finished"
    session_id: str
    group_id: str
    reward: float = Field(allow_inf_nan=False)
    status: Literal["completed", "truncated", "failed"] = "completed"
    num_chunks: int = Field(ge=0)
    """How many chunk records the session produced: the collector waits for all of them."""
    error: str = Field(default="", max_length=200)
    """Why a ``failed`` session failed, as the agent saw it (``unreachable``, ``timeout``, an error
    name): a failure of a dependency does not use up the prompt's retries."""

    def key(self) -> str:
        return self.group_id


class SessionRejected(Record):
    """The proxy rejected the session (span cap, version change, preempt) or it errored."""

    topic_attr: ClassVar[str] = "events"
    type: Literal["session_rejected"] = "session_rejected"
    session_id: str
    group_id: str
    error: str
    detail: dict[str, Any] = Field(default_factory=dict)
    num_chunks: int | None = Field(ge=0)
    """Chunks the session published; ``None`` when the publisher cannot know (the rollout runner
    ending a session its proxy lost): the collector then does not wait for chunks."""

    def key(self) -> str:
        return self.group_id


# --------------------------------------------------------------------------- rollout.groups


class Segment(BaseModel):
    """One training sample cut from a trajectory; all lists have one entry per token."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    segment_index: int = Field(ge=0)
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    """Rollout logprob per token (0.0 on context tokens)."""
    versions: list[Label]
    """Version per token, normalised (None on context tokens)."""
    finish_reason: str = "stop"
    sampling: list[tuple[SamplingParams | None, int]] = Field(default_factory=list)
    """Sampling parameters per token, run-length encoded like ``Chunk.token_versions`` (None on context
    tokens and on output tokens whose chunk recorded none); empty: none recorded."""

    @model_validator(mode="after")
    def _runs_cover_the_tokens(self) -> Segment:
        if self.sampling:
            total = sum(count for _, count in self.sampling)
            if total != len(self.token_ids) or any(count < 1 for _, count in self.sampling):
                raise ValueError(f"sampling runs cover {total} tokens, token_ids has {len(self.token_ids)}")
        return self

    def token_sampling(self) -> list[SamplingParams | None]:
        """The sampling parameters of every token (all None when none were recorded)."""
        return decode_runs(self.sampling) if self.sampling else [None] * len(self.token_ids)


class Trajectory(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    session_id: str
    status: Literal["completed", "truncated", "failed", "rejected"]
    reward: float = Field(default=0.0, allow_inf_nan=False)
    error: str = ""
    segments: list[Segment]


class CompletedGroup(Record):
    """A GRPO group whose sessions all finished or were rejected: the audit log."""

    topic_attr: ClassVar[str] = "groups"
    type: Literal["group"] = "group"
    group_id: str
    prompt_id: str
    attempt: int = Field(default=0, ge=0)
    failed: bool
    trajectories: list[Trajectory]
    prompt: dict[str, Any] = Field(default_factory=dict)
    free_retries: int = Field(default=0, ge=0)

    def key(self) -> str:
        return self.group_id


# --------------------------------------------------------------------------- staleness.decisions / train.batches


class WindowInfo(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    keep_versions: int
    current_version: Label
    current_index: int | None
    cutoff_index: int | None


class DecisionRecord(Record):
    """One window decision about one group (see ``shared.staleness.Decision``)."""

    topic_attr: ClassVar[str] = "decisions"
    type: Literal["decision"] = "decision"
    group_id: str
    prompt_id: str
    attempt: int = Field(ge=0)
    decision: Literal[
        "kept", "dropped_stale", "dropped_retroactive", "failed_retry", "failed_dropped", "dropped_no_signal"
    ]
    versions: list[RealLabel]
    window: WindowInfo
    collector: str = ""
    step: int | None = Field(default=None, ge=0)
    """Position of the window step that made this decision in the one window all replicas share:
    a total order across partitions and replicas (replay and export follow it)."""

    def key(self) -> str:
        return self.group_id


class GroupRef(BaseModel):
    """Where a completed group lives on ``rollout.groups``."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    group_id: str
    partition: int = Field(ge=0)
    offset: int = Field(ge=0)
    withheld: list[str] = Field(default_factory=list)
    """Session ids of trajectories the window withheld (``REIN_STALE_GROUPS=withhold``): their rewards
    stay in the group's baseline, their tokens leave the loss."""


class GapInfo(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    min: int
    max: int
    mean: float


class BatchManifest(Record):
    """One training batch: group references, the window then, drops since the last batch."""

    topic_attr: ClassVar[str] = "batches"
    type: Literal["batch"] = "batch"
    batch_id: str
    index: int = Field(ge=0)
    groups: list[GroupRef] = Field(min_length=1)
    window: WindowInfo
    version_gap: GapInfo | None
    dropped: list[dict[str, str]] = Field(default_factory=list)
    """``{"group_id", "decision"}`` of each drop since the previous manifest."""
    drops_in_batch: int = Field(ge=0)
    drops_cumulative: int = Field(ge=0)
    generated_tokens_cumulative: int = Field(default=0, ge=0)
    """Trainable tokens of every group the window decided so far (0 on records from before it was counted)."""
    untrained_tokens_cumulative: dict[str, int] = Field(default_factory=dict)
    """Of those, the tokens left untrained, by cause (``window``, ``no_signal``, ``failed``:
    :data:`shared.staleness.UNTRAINED_CAUSES`); empty on older records."""

    def key(self) -> str:
        return self.batch_id


# --------------------------------------------------------------------------- weights


class WeightPublished(Record):
    """The trainer wrote a checkpoint; ``seq`` orders versions for every window."""

    topic_attr: ClassVar[str] = "weights"
    type: Literal["weight_published"] = "weight_published"
    version: RealLabel
    seq: int = Field(ge=0)
    path: str
    digest: str
    step: int = Field(ge=0)
    last_index: int | None = Field(default=None, ge=-1)
    """Highest batch-manifest index these weights consumed (trained, or skipped without gradient); -1
    before any. A runner paces new prompts on it (services/rollout/pacing.py). None on older records."""

    def key(self) -> str:
        return self.version


class WeightApplied(Record):
    """The broadcaster loaded a version on every engine and resumed every proxy."""

    topic_attr: ClassVar[str] = "weights"
    type: Literal["weight_applied"] = "weight_applied"
    version: RealLabel
    seq: int = Field(ge=0)
    digest: str
    engines: list[str] = Field(default_factory=list)
    last_index: int | None = Field(default=None, ge=-1)
    """The applied version's :attr:`WeightPublished.last_index`."""

    def key(self) -> str:
        """Not the bare version: ``weights`` is compacted, and the version's ``WeightPublished`` must stay."""
        return f"{self.version}:applied"


class BatchSkipped(Record):
    """The trainer consumed manifest ``index`` without updating its weights (the batch carried no
    gradient: ``reason`` as in ``metrics.jsonl``), so no version follows it; ``version`` is the one
    it still holds. A sync-mode runner opens its next wave on it as on a ``WeightApplied``."""

    topic_attr: ClassVar[str] = "weights"
    type: Literal["batch_skipped"] = "batch_skipped"
    index: int = Field(ge=0)
    batch_id: str
    reason: str
    version: RealLabel

    def key(self) -> str:
        """One key for every skip: ``weights`` is compacted and readers need only the newest (highest) index."""
        return "batch_skipped"


# --------------------------------------------------------------------------- rollout.retries


class RetryRequest(Record):
    """Run this prompt's group again (the prompt keeps its id).

    Each failure adds one to ``attempt`` (it counts toward ``max_retries``) or, when only a
    dependency failed, to ``free_retries``; so ``(prompt_id, attempt, free_retries)`` names one
    retry, and two records with the same three are one retry published twice."""

    topic_attr: ClassVar[str] = "retries"
    type: Literal["retry"] = "retry"
    prompt_id: str
    attempt: int = Field(ge=0)
    free_retries: int = Field(default=0, ge=0)
    previous_group_id: str
    prompt: dict[str, Any] = Field(default_factory=dict)

    def key(self) -> str:
        return self.prompt_id
