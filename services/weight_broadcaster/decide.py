"""What the broadcaster does next, pure (no HTTP, no Kafka): unit-tested tables.

- :func:`plan_events`: of the weight events one poll returned, which to register and
  which single one to apply (the newest; older ones are superseded).
- :func:`classify`: apply an event, or skip it because the engines already serve it
  or something newer.
- :func:`after_pause`: given every proxy's pause answer, update, or resume and retry
  later, or give up this version (never update an engine while a proxy has a generation on it in flight:
  that generation's tokens would carry a version that did not make them).
- :func:`renew_before_update`: whether the pause round took long enough that a lease may have run out.
- :func:`backoff_s`: bounded exponential backoff between attempts.
- :func:`update_targets`: which engines an update goes to (every fixed one; a registered one only
  while it answers: a dead one whose registration has not lapsed yet must not fail the version).
- :func:`not_served`: why an engine's ``/get_model_info`` shows it is not serving an event's
  version (its ``weight_version``, and rein's ``digest`` where the engine reports one).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from shared.schemas import WeightApplied, WeightPublished


@dataclass(frozen=True)
class EventPlan:
    register: list[WeightPublished]
    """Every distinct version seen, in sequence order: the registry must know them all."""
    apply: WeightPublished | None
    """The newest one; the only one worth loading."""
    superseded: list[WeightPublished]
    """Older versions of the same poll that are not loaded (a newer one is)."""


def plan_events(events: Iterable[WeightPublished]) -> EventPlan:
    by_seq: dict[int, WeightPublished] = {}
    for event in events:
        by_seq.setdefault(event.seq, event)  # replays of one version carry the same seq
    ordered = [by_seq[s] for s in sorted(by_seq)]
    if not ordered:
        return EventPlan(register=[], apply=None, superseded=[])
    return EventPlan(register=ordered, apply=ordered[-1], superseded=ordered[:-1])


class EventAction(enum.StrEnum):
    APPLY = "apply"
    ALREADY_APPLIED = "already_applied"
    """Every engine serves this version with this digest: only (re)announce it."""
    OLDER = "older"
    """Something newer is already applied; loading this would roll the engines back."""


def classify(
    event: WeightPublished, applied_seq: int | None, engines: Sequence[tuple[str | None, str | None]]
) -> EventAction:
    """``applied_seq``: sequence of the newest version already applied (None: none yet);
    ``engines``: ``(weight_version, digest)`` each engine reports now (None: unknown/unreachable;
    the digest is also None where the engine reports none, as SGLang). Already applied means
    every engine serves this label, with this digest where it reports one (a step that did not
    change the weights still gets its new label loaded)."""
    if applied_seq is not None and event.seq < applied_seq:
        return EventAction.OLDER
    if engines and all(not not_served(event, v, d) for v, d in engines):
        return EventAction.ALREADY_APPLIED
    return EventAction.APPLY


def update_targets(answered: Sequence[tuple[str, bool]], fixed: Iterable[str]) -> tuple[list[str], list[str]]:
    """``answered``: each engine and whether its ``/get_model_info`` answered. Returns the engines to
    update (every fixed one, answering or not: its failure is reported as before; each registered one
    that answered) and the registered ones left out (reported as lagging; reconciled once they answer)."""
    fixed_set = set(fixed)
    targets = [url for url, ok in answered if ok or url in fixed_set]
    skipped = [url for url, ok in answered if not ok and url not in fixed_set]
    return targets, skipped


def not_served(event: WeightPublished, weight_version: str | None, digest: str | None) -> str:
    """Empty when an engine reporting ``weight_version`` (and ``digest``, None when it reports
    none) serves ``event``; else the reason. SGLang reports no digest: its label is the proof."""
    if weight_version != event.version:
        return f"engine serves weight_version {weight_version!r}, not {event.version!r}"
    if digest is not None and digest != event.digest:
        return f"engine reports digest {digest}, the event says {event.digest}"
    return ""


@dataclass(frozen=True)
class PauseAnswer:
    """One proxy's answer to ``POST /v1/rollout/pause``."""

    proxy: str
    ok: bool
    """The call returned 2xx with a body."""
    quiesced: bool
    preempted: int = 0
    error: str = ""


class PauseAction(enum.StrEnum):
    UPDATE = "update"
    RETRY = "retry"
    """Resume every proxy, back off, pause again."""
    GIVE_UP = "give_up"
    """Out of attempts: resume every proxy and leave this version unapplied."""


@dataclass(frozen=True)
class PauseDecision:
    action: PauseAction
    unquiesced: list[str]
    """Proxies whose pause failed or did not quiesce."""


def after_pause(answers: Sequence[PauseAnswer], attempt: int, max_attempts: int) -> PauseDecision:
    """``attempt`` counts from 1. Update only when every proxy answered and quiesced."""
    if attempt < 1 or max_attempts < 1:
        raise ValueError(f"attempt ({attempt}) and max_attempts ({max_attempts}) must be >= 1")
    bad = [a.proxy for a in answers if not (a.ok and a.quiesced)]
    if not bad:
        return PauseDecision(PauseAction.UPDATE, [])
    if attempt >= max_attempts:
        return PauseDecision(PauseAction.GIVE_UP, bad)
    return PauseDecision(PauseAction.RETRY, bad)


def renew_before_update(elapsed_s: float, lease_s: float) -> bool:
    """Whether every proxy's pause must be renewed before the update starts, ``elapsed_s`` after the
    pause round began. Each proxy's lease started after that (when its quiesce wait ended), so
    each has at least ``lease_s - elapsed_s`` left, and the update's keeper renews every
    ``lease_s / 3``: within the first third of the lease no lease can have run out, and the
    renewal (one more call to every paused proxy) is skipped."""
    return elapsed_s > lease_s / 3


def backoff_s(attempt: int, base_s: float, max_s: float) -> float:
    """Delay after failed attempt ``attempt`` (1, 2, ...): ``base · 2^(attempt−1)`` capped at ``max_s``."""
    if attempt < 1:
        raise ValueError(f"attempt must be >= 1, got {attempt}")
    return float(min(max_s, base_s * 2 ** (attempt - 1)))


def latest_applied(records: Sequence[object]) -> WeightPublished | None:
    """The newest version (by ``seq``) that was both published and announced applied, from the
    ``weights`` topic read back: what every engine should serve when nothing newer arrives."""
    applied = {(r.version, r.digest) for r in records if isinstance(r, WeightApplied)}
    done = [r for r in records if isinstance(r, WeightPublished) and (r.version, r.digest) in applied]
    return max(done, key=lambda r: r.seq, default=None)
