from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.collector.settings import CollectorSettings
from services.proxy.settings import ProxySettings
from services.rollout.settings import RolloutSettings
from shared.names import RedisKeys
from shared.settings import RedisSettings, ServiceSettings, SettingsError, env_name, load, setting_loc, settings_env
from shared.staleness import NoSignalGroups


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


def test_settings_env_gives_back_the_values_it_was_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the local stack composes a service's environment with: each value, read back by the service's own
    settings class from the variables, is the value given (lists as JSON, booleans, nested models, enums)."""
    values = {"task": "arithmetic", "agent_command": ["llm", "{prompt}"], "mode": "sync", "temperature": 0.7,
              "kafka": {"linger_ms": 20, "bootstrap_servers": "127.0.0.1:1"}, "log_json": False}
    env = settings_env(RolloutSettings, values)
    assert env["REIN_KAFKA__LINGER_MS"] == "20" and env["REIN_LOG_JSON"] == "false"
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    back = load(RolloutSettings)
    assert (back.task, back.agent_command, back.mode, back.temperature, back.log_json) == (
        "arithmetic", ["llm", "{prompt}"], "sync", 0.7, False)
    assert (back.kafka.linger_ms, back.kafka.bootstrap_servers) == (20, "127.0.0.1:1")
    collector = settings_env(CollectorSettings, {"no_signal_groups": NoSignalGroups.KEEP})
    assert collector == {"REIN_NO_SIGNAL_GROUPS": "keep"}


def test_settings_env_refuses_an_unknown_name_or_a_bad_value_before_any_service_starts() -> None:
    with pytest.raises(SettingsError, match=r"RolloutSettings has no setting 'tsak' \(REIN_TSAK\); known: .*task"):
        settings_env(RolloutSettings, {"tsak": "arithmetic"})
    with pytest.raises(SettingsError, match="REIN_KAFKA__LINGER_MSS"):
        settings_env(RolloutSettings, {"kafka": {"linger_mss": 1}})
    with pytest.raises(SettingsError, match=r"REIN_GROUP_SIZE: .*greater than or equal to 1 \(got 0\)"):
        settings_env(RolloutSettings, {"group_size": 0})
    with pytest.raises(SettingsError, match=r"REIN_TASK: .*unknown task 'nope'"):
        settings_env(RolloutSettings, {"task": "nope"})
    with pytest.raises(SettingsError, match="REIN_GROUP_SIZE"):  # None stands only for a default of None
        settings_env(RolloutSettings, {"group_size": None})


def test_settings_env_leaves_a_none_whose_default_is_none_unset() -> None:
    assert settings_env(ProxySettings, {"max_preempts": None}) == {}
    assert settings_env(ProxySettings, {"max_preempts": 2}) == {"REIN_MAX_PREEMPTS": "2"}


def test_a_variables_field_path_is_the_inverse_of_its_name() -> None:
    for loc in [("kafka", "linger_ms"), ("max_preempts",), ("redis", "replica_ack_timeout_s")]:
        assert setting_loc(env_name(loc)) == loc
    with pytest.raises(ValueError, match="lacks the REIN_ prefix"):
        setting_loc("KAFKA__LINGER_MS")
