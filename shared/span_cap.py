"""The span cap, pure: how many weight versions one session (one agent's trajectory) may span.

The proxy applies :func:`check_span` before it generates a turn and after a preempted generation
resumes; a session over the cap is rejected with ``partial_rollout_staleness_exceeded``. The first
of rein's three staleness levels (the collector's window in :mod:`shared.staleness`, the trainer's
loss mask in :mod:`services.trainer.samples` are the others).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from shared.versions import distinct_real


@dataclass(frozen=True)
class SpanRejection:
    """A session would span more real versions than ``max_preempts + 1``."""

    versions: tuple[str, ...]
    max_preempts: int
    session_id: str

    @property
    def version_span(self) -> int:
        return len(self.versions)

    @property
    def version_switches(self) -> int:
        return max(0, len(self.versions) - 1)

    @property
    def max_version_span(self) -> int:
        return self.max_preempts + 1

    def detail(self) -> dict[str, object]:
        """The body of a 502 ``partial_rollout_staleness_exceeded`` (docs/architecture.md)."""
        return {
            "error": "partial_rollout_staleness_exceeded",
            "message": (
                f"session {self.session_id} would span {self.version_span} weight versions "
                f"{list(self.versions)}; at most {self.max_version_span} allowed (max_preempts={self.max_preempts})"
            ),
            "versions": list(self.versions),
            "version_span": self.version_span,
            "version_switches": self.version_switches,
            "max_preempts": self.max_preempts,
            "max_version_span": self.max_version_span,
            "session_id": self.session_id,
        }


def check_span(
    session_versions: Iterable[str | None],
    candidate_versions: Iterable[str | None],
    max_preempts: int | None,
    session_id: str,
) -> SpanRejection | None:
    """Reject when the session's distinct real versions plus the candidates exceed the cap.

    ``session_versions`` are every version the session recorded (all turns and
    segments, observation order); ``candidate_versions`` are the engine's current
    version (before generating) or the new chunk's versions (after it). Distinct
    versions count, not preempt events: a switch between turns costs the same as a
    mid-generation preempt, a preempt that resumes on the same version costs
    nothing. ``None`` means no cap.
    """
    if max_preempts is None:
        return None
    if max_preempts < 0:
        raise ValueError(f"max_preempts must be >= 0 or None, got {max_preempts}")
    versions = distinct_real([*session_versions, *candidate_versions])
    if len(versions) > max_preempts + 1:
        return SpanRejection(tuple(versions), max_preempts, session_id)
    return None
