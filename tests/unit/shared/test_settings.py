from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.collector.settings import CollectorSettings
from services.rollout.settings import RolloutSettings
from shared.names import RedisKeys
from shared.settings import RedisSettings, ServiceSettings, SettingsError, load


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


@pytest.mark.parametrize(("old", "new", "cls"), [
    ("REIN_GROUP_ID", "REIN_CONSUMER_GROUP", CollectorSettings),  # a Kafka consumer group, not a GRPO group
    ("REIN_MODEL", "REIN_REQUEST_MODEL", RolloutSettings),  # the request's model name, not the weights to load
])
def test_a_renamed_variable_stops_the_service_with_its_new_name(
    monkeypatch: pytest.MonkeyPatch, old: str, new: str, cls: type[ServiceSettings]
) -> None:
    monkeypatch.setenv(old, "x")
    with pytest.raises(SettingsError, match=f"{old} is now {new}"):
        load(cls)
    monkeypatch.delenv(old)
    monkeypatch.setenv(new, "x")
    assert load(cls).model_dump()[new.removeprefix("REIN_").lower()] == "x"


def test_deploy_script_variables_are_not_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REIN_CACHE", "/tmp/x")
    assert load(ServiceSettings).log_level == "info"


def test_every_redis_key_of_a_deployment_shares_one_hash_tag() -> None:
    """One Redis Cluster slot per deployment: the window's transaction and the registry's scripts span keys."""
    keys = RedisKeys("run7")
    names = [getattr(keys, n) for n in dir(RedisKeys) if isinstance(getattr(RedisKeys, n), property)]
    names.append(keys.prompt_cursor("arithmetic", 3))
    assert len(names) >= 12 and all(name.startswith("{run7}:") for name in names), names
    assert RedisKeys("{a}b").window == "{a}b:window"  # a prefix with its own tag is kept as is


@pytest.mark.parametrize(("values", "error"), [
    ({"sentinels": ["127.0.0.1"]}, "is not host:port"),
    ({"sentinels": [":26379"]}, "is not host:port"),
    ({"replicas_acked": 1, "replica_ack_timeout_s": 5.0, "socket_timeout_s": 5.0}, "must be below socket_timeout_s"),
])
def test_redis_failover_settings_that_cannot_work_are_refused(values: dict[str, object], error: str) -> None:
    with pytest.raises(ValidationError, match=error):
        RedisSettings.model_validate(values)


def test_redis_failover_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REIN_REDIS__SENTINELS", '["127.0.0.1:26379", "10.0.0.2:26379"]')
    monkeypatch.setenv("REIN_REDIS__REPLICAS_ACKED", "1")
    redis = load(ServiceSettings).redis
    assert redis.sentinels == ["127.0.0.1:26379", "10.0.0.2:26379"] and redis.replicas_acked == 1
    assert redis.sentinel_master == "rein" and redis.replica_ack_timeout_s < redis.socket_timeout_s
