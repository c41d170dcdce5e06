"""Weight-version labels and their order.

A label is an opaque string. It is normalised once, where it enters the system
(:func:`real_version`: the record schemas, the proxy's engine client, the
broadcaster's engine client, the replay file reader); everything after that takes
``str | None`` as it is, None meaning "no real version". Labels are ordered by the sequence number the trainer published
with it, never by text and never by when a collector first saw it (a late group with an old label is
old, not newest). Labels nobody published (an engine started with its own label)
are placed after the published ones, in observation order, and counted.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import Annotated, TypeVar

from pydantic import BeforeValidator

_T = TypeVar("_T")

NOT_REAL = frozenset({"", "-1", "unknown", "none"})


def real_version(value: object) -> str | None:
    """The normalised label, or None when ``value`` carries no real version.

    Not real: None, and after strip + lower-case ``""``, ``"-1"``, ``"unknown"``,
    ``"none"``. Integers count by their string form (``0`` is real, ``-1`` is not).
    The stripped label keeps its case.
    """
    if value is None or isinstance(value, bool):
        return None
    text = str(value).strip()
    if text.lower() in NOT_REAL:
        return None
    return text


def _label(value: object) -> object:
    """A text label normalised (not real: None); any other value is left to the field's type check."""
    return real_version(value) if isinstance(value, str) else value


def _real_label(value: object) -> object:
    if isinstance(value, str) and real_version(value) is None:
        raise ValueError(f"{value!r} is not a real version label")
    return _label(value)


Label = Annotated[str | None, BeforeValidator(_label)]
"""A record's version field: normalised where the record is built or decoded (None: no real version)."""
RealLabel = Annotated[str, BeforeValidator(_real_label)]
"""A record's version field that must name a real version (a published or applied weight version)."""


def distinct_real(labels: Iterable[str | None]) -> list[str]:
    """Distinct real labels of normalised ``labels`` (None skipped) in first-occurrence order."""
    return list(dict.fromkeys(label for label in labels if label is not None))


VersionRuns = list[tuple[str | None, int]]
"""Run-length encoded per-token versions: ``[(label, count), ...]`` in token order."""


def encode_runs(items: Iterable[_T]) -> list[tuple[_T, int]]:
    """Consecutive equal items (normalised labels, sampling parameters) as ``(item, count)`` runs."""
    runs: list[tuple[_T, int]] = []
    for item in items:
        if runs and runs[-1][0] == item:
            runs[-1] = (item, runs[-1][1] + 1)
        else:
            runs.append((item, 1))
    return runs


def decode_runs(runs: Iterable[tuple[_T, int]]) -> list[_T]:
    """The per-token items of ``runs``."""
    return [item for item, count in runs for _ in range(count)]


class VersionRegistry:
    """Published labels ordered by sequence number, then unregistered ones by observation.

    ``index(label)`` is O(log n) in the number of published versions, so a window
    decision stays flat as the registry grows (a linear search of the labels would
    not). The Redis-backed registry of the collector keeps the same order with a
    sorted set; this class is the rule and the in-memory form (replay, tests).
    """

    def __init__(self) -> None:
        self._seq: dict[str, int] = {}
        self._sorted_seqs: list[int] = []
        self._unregistered: dict[str, int] = {}

    def publish(self, name: str, seq: int) -> bool:
        """Register the real label ``name`` at sequence ``seq``; True when it was new.

        Publishing the same label again with the same sequence is a no-op (events
        are replayed from Kafka); a different sequence for a known label, or a
        sequence already used by another label, is an error.
        """
        if seq < 0:
            raise ValueError(f"sequence number must be >= 0, got {seq}")
        known = self._seq.get(name)
        if known is not None:
            if known != seq:
                raise ValueError(f"version {name!r} already published with sequence {known}, not {seq}")
            return False
        pos = bisect.bisect_left(self._sorted_seqs, seq)
        if pos < len(self._sorted_seqs) and self._sorted_seqs[pos] == seq:
            raise ValueError(f"sequence {seq} already used by another version")
        self._sorted_seqs.insert(pos, seq)
        self._seq[name] = seq
        self._unregistered.pop(name, None)
        return True

    def observe(self, name: str) -> None:
        """Note a real label seen in data; one never published becomes unregistered."""
        if name not in self._seq and name not in self._unregistered:
            self._unregistered[name] = len(self._unregistered)

    def is_registered(self, label: str) -> bool:
        return label in self._seq

    def sequence(self, label: str) -> int | None:
        return self._seq.get(label)

    def index(self, label: str) -> int:
        """Position of ``label`` in the order; KeyError for a label never published nor observed."""
        seq = self._seq.get(label)
        if seq is not None:
            return bisect.bisect_left(self._sorted_seqs, seq)
        rank = self._unregistered.get(label)
        if rank is None:
            raise KeyError(f"version {label!r} was never published nor observed")
        unregistered_ranks = sorted(self._unregistered.values())
        return len(self._sorted_seqs) + bisect.bisect_left(unregistered_ranks, rank)

    @property
    def unregistered(self) -> list[str]:
        return sorted(self._unregistered, key=self._unregistered.__getitem__)

    def __len__(self) -> int:
        return len(self._seq) + len(self._unregistered)
