"""Command-line argument types that ``rein up`` and ``make demo`` share (one spelling for each value)."""

from __future__ import annotations

import argparse


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
