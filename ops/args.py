"""Command-line argument types that ``rein up`` and ``make demo`` share (one spelling for each value)."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Iterator


def max_preempts_arg(text: str) -> int | None:
    """A ``--max-preempts`` value (``rein up``, ``make demo``): a count >= 0, or ``none`` for no span cap, as
    the proxy's ``REIN_MAX_PREEMPTS`` takes it."""
    if text.strip().lower() == "none":
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"--max-preempts must be a count >= 0 or none, got {text!r}")
    return value


class RegistryChoices:
    """argparse ``choices`` that are a registry's names (``shared.registry``), read from
    ``module.attribute`` on first use: when a value is given or ``--help`` lists them. The
    corrections' registry imports torch (about 1.5 s of CPU), which a demo run on its defaults
    never needs in its own process."""

    def __init__(self, module: str, attribute: str) -> None:
        self._where = (module, attribute)
        self._names: list[str] | None = None

    def names(self) -> list[str]:
        if self._names is None:
            module, attribute = self._where
            self._names = list(getattr(importlib.import_module(module), attribute))
        return self._names

    def __contains__(self, value: object) -> bool:
        return value in self.names()

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
