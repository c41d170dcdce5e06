"""docs/settings.md is what the settings classes say, and every ``REIN_*`` variable the docs name is in it."""

from __future__ import annotations

import re
from pathlib import Path

from ops.settings_reference import DOC, SERVICES, _settings_class, render, rows
from shared.settings import NOT_SETTINGS

REPO = Path(__file__).resolve().parents[3]
AGENT_ENV = frozenset({"REIN_PROMPT"})
"""Set by the rollout runner for a command agent (services/rollout/command_agent.py), read by no service."""


def test_the_reference_is_current() -> None:
    assert DOC.read_text() == render(), "docs/settings.md is stale: run `python -m ops.settings_reference`"


def test_every_setting_has_a_meaning() -> None:
    empty = [env for _, _, path in SERVICES for env, _, _, text in rows(_settings_class(path)) if not text]
    assert empty == [], f"fields without a docstring (their meaning in docs/settings.md): {empty}"


def test_every_variable_the_docs_name_exists() -> None:
    known = set(re.findall(r"`(REIN_[A-Z0-9_]+)`", render())) | NOT_SETTINGS | AGENT_ENV
    docs = [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]
    unknown = {f"{p.relative_to(REPO)}: {v}" for p in docs
               for v in re.findall(r"\bREIN_[A-Z0-9_]*[A-Z0-9]\b", p.read_text()) if v not in known}
    assert sorted(unknown) == [], "docs name variables no service reads"
