"""RolloutSettings: defaults parse, env names, cross-field rules fail at start with the variable's name."""

from __future__ import annotations

import os

import pytest

from services.rollout.settings import RolloutSettings
from shared.settings import SettingsError, load


def test_defaults_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("REIN_"):
            monkeypatch.delenv(key)
    s = load(RolloutSettings)
    assert (s.group_size, s.mode, s.max_groups, s.proxy_url) == (8, "async", 0, "http://127.0.0.1:8000")


def test_env_vars(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REIN_MODE", "sync")
    monkeypatch.setenv("REIN_GROUPS_PER_STEP", "4")
    monkeypatch.setenv("REIN_PROXY_URL", "http://proxy:8000/")
    monkeypatch.setenv("REIN_TOPICS__RETRIES", "r.test")
    s = load(RolloutSettings)
    assert (s.mode, s.groups_per_step, s.proxy_url, s.topics.retries) == ("sync", 4, "http://proxy:8000", "r.test")


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"proxy_url": "proxy:8000"}, "REIN_PROXY_URL"),
        ({"proxy_url": "http://proxy:8000/v1"}, "without /v1"),
        ({"group_size": 0}, "REIN_GROUP_SIZE"),
        ({"mode": "fast"}, "REIN_MODE"),
        ({"mode": "sync", "groups_per_step": 8, "max_groups": 4}, "REIN_MAX_GROUPS"),
        ({"no_such_field": 1}, "REIN_NO_SUCH_FIELD"),
    ],
)
def test_bad_values_name_the_variable(overrides: dict[str, object], needle: str) -> None:
    with pytest.raises(SettingsError, match=needle):
        load(RolloutSettings, **overrides)
