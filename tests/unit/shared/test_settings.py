from __future__ import annotations

import pytest

from shared.settings import ServiceSettings, SettingsError, load


def test_nested_variables_and_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REIN_KAFKA__BOOTSTRAP_SERVERS", "127.0.0.1:1234")
    monkeypatch.setenv("REIN_TOPICS__CHUNKS", "x.chunks")
    s = load(ServiceSettings)
    assert s.kafka.bootstrap_servers == "127.0.0.1:1234"
    assert s.topics.chunks == "x.chunks" and s.topics.events == "rollout.events"


def test_invalid_value_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REIN_KAFKA__REQUEST_TIMEOUT_MS", "-5")
    with pytest.raises(SettingsError, match="REIN_KAFKA__REQUEST_TIMEOUT_MS"):
        load(ServiceSettings)


def test_unknown_nested_key_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REIN_REDIS__URLL", "redis://x")
    with pytest.raises(SettingsError, match="REIN_REDIS__URLL"):
        load(ServiceSettings)


def test_unknown_top_level_variable_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REIN_LOG_LEVLE", "debug")
    with pytest.raises(SettingsError, match="REIN_LOG_LEVLE"):
        load(ServiceSettings)


def test_deploy_script_variables_are_not_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REIN_CACHE", "/tmp/x")
    assert load(ServiceSettings).log_level == "info"
