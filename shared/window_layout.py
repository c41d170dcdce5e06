"""The shared window's layout in Redis: one writer, one reader, both built on this module.

The collector's :class:`services.collector.window_store.WindowStore` is the only writer of
the window keys (:class:`shared.names.RedisKeys`); it encodes the window hash and the config
hash with :func:`encode_window` and :func:`encode_config` and decodes them with
:func:`decode_window`. ``rein status`` reads the same keys through :class:`WindowReader`,
which never writes (no registry ``observe``, no WATCH). Layout:

- ``window`` (hash): ``current``, ``batches``, ``steps``, ``drops_total``,
  ``drops:<decision>`` (counter per drop reason), ``dropped_since`` (JSON pairs),
  ``no_signal_run`` (groups without signal in a row), ``tokens_generated`` and
  ``untrained:<cause>`` (the :class:`shared.staleness.TokenTally`; absent fields read 0);
- ``window_config`` (hash): ``keep_versions``, ``batch_groups``, ``max_retries``,
  ``max_free_retries`` (integers), ``no_signal_groups`` (``drop`` / ``keep``), ``stale_groups``
  (``drop`` / ``withhold``);
- ``pending_order`` and ``outbox`` (lists);
- the registry's sorted sets (``registry_order`` by sequence, ``unregistered`` by
  observation), whose order rule is :class:`shared.versions.VersionRegistry`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from shared.names import RedisKeys
from shared.staleness import UNTRAINED_CAUSE_NAMES, TokenTally, WindowSettings, WindowState
from shared.versions import VersionRegistry

DROPS_PREFIX = "drops:"
"""Window-hash fields ``drops:<decision>`` count the groups dropped for each reason."""


UNTRAINED_PREFIX = "untrained:"
"""Window-hash fields ``untrained:<cause>`` hold the tokens left untrained for each cause."""


def drops_field(decision: str) -> str:
    return f"{DROPS_PREFIX}{decision}"


@dataclass(frozen=True)
class WindowHash:
    """The decoded ``window`` hash (an absent hash decodes to the empty window)."""

    current: str | None
    batches: int
    steps: int
    drops_total: int
    dropped_since: tuple[tuple[str, str], ...]
    drops_by_reason: dict[str, int]
    no_signal_run: int = 0
    tokens: TokenTally = field(default_factory=TokenTally)


def decode_window(raw: Mapping[str, str]) -> WindowHash:
    """Raises ValueError (or TypeError) on a malformed ``dropped_since``."""
    dropped = tuple((str(g), str(d)) for g, d in json.loads(raw.get("dropped_since", "[]")))
    return WindowHash(
        current=raw.get("current"),
        batches=int(raw.get("batches", 0)),
        steps=int(raw.get("steps", 0)),
        drops_total=int(raw.get("drops_total", 0)),
        dropped_since=dropped,
        drops_by_reason={k[len(DROPS_PREFIX):]: int(v) for k, v in raw.items() if k.startswith(DROPS_PREFIX)},
        no_signal_run=int(raw.get("no_signal_run", 0)),
        tokens=TokenTally(
            int(raw.get("tokens_generated", 0)),
            **{cause: int(raw.get(f"{UNTRAINED_PREFIX}{cause}", 0)) for cause in UNTRAINED_CAUSE_NAMES},
        ),
    )


def encode_window(after: WindowState, steps: int) -> dict[str, str | int]:
    """The ``window`` fields a step rewrites (drop counters are incremented separately)."""
    window: dict[str, str | int] = {
        "batches": after.batches,
        "drops_total": after.drops_total,
        "dropped_since": json.dumps([list(p) for p in after.dropped_since_batch]),
        "steps": steps,
        "no_signal_run": after.no_signal_run,
        "tokens_generated": after.tokens.generated,
        **{f"{UNTRAINED_PREFIX}{cause}": n for cause, n in after.tokens.by_cause().items()},
    }
    if after.current is not None:
        window["current"] = after.current
    return window


def encode_config(config: WindowSettings) -> dict[str, str]:
    """The ``window_config`` hash every replica must agree on."""
    return {
        "keep_versions": str(config.keep_versions),
        "batch_groups": str(config.batch_groups),
        "max_retries": str(config.max_retries),
        "max_free_retries": str(config.max_free_retries),
        "no_signal_groups": config.no_signal_groups.value,
        "stale_groups": config.stale_groups.value,
    }


class WindowReader:
    """Read-only access to the window keys and the registry order (for ``rein status``)."""

    def __init__(self, client: Any, keys: RedisKeys) -> None:
        self.client = client
        self.keys = keys

    def window(self) -> WindowHash:
        return decode_window(cast(dict[str, str], self.client.hgetall(self.keys.window)))

    def config(self) -> dict[str, int | str]:
        """The agreed window settings (integers as ints); empty before any collector claimed them."""
        raw = cast(dict[str, str], self.client.hgetall(self.keys.window_config))
        return {k: int(v) if v.lstrip("-").isdigit() else v for k, v in raw.items()}

    def registry(self) -> tuple[list[tuple[str, int]], VersionRegistry]:
        """Published ``(label, seq)`` pairs in order, and the registry they and the unregistered labels form."""
        k = self.keys
        pairs = [(str(label), int(seq)) for label, seq in self.client.zrange(k.registry_order, 0, -1, withscores=True)]
        registry = VersionRegistry()
        for label, seq in pairs:
            registry.publish(label, seq)
        for label in cast(list[str], self.client.zrange(k.unregistered, 0, -1)):
            registry.observe(label)
        return pairs, registry

    def pending_count(self) -> int:
        return int(self.client.llen(self.keys.pending_order))

    def outbox_size(self) -> int:
        return int(self.client.llen(self.keys.outbox))

