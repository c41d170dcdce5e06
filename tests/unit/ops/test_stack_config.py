"""The local stack's configuration: each service's knobs by the names its settings class declares, checked when
the config is made; the values several services share set once."""

from __future__ import annotations

from pathlib import Path

import pytest

from ops.local.credentials import Credentials
from ops.local.stack import CONSUMER_GROUPS, SERVICES, STACK_WIDE, SharedInfra, StackConfig, settings_class
from shared.names import Topics
from shared.settings import SettingsError, load


def test_a_knob_left_out_keeps_the_services_default_and_one_given_reaches_only_its_service(tmp_path: Path) -> None:
    config = StackConfig(run_dir=tmp_path, services={"collector": {"keep_versions": 1}})
    assert config.setting("collector", "keep_versions") == 1
    assert config.setting("rollout", "max_concurrent_groups") == settings_class("rollout").model_fields[
        "max_concurrent_groups"].default
    assert config.env_of("collector")["REIN_KEEP_VERSIONS"] == "1"
    assert not any("KEEP_VERSIONS" in name for s in SERVICES if s != "collector" for name in config.env_of(s))


def test_the_shared_values_reach_every_service_that_reads_them(tmp_path: Path) -> None:
    config = StackConfig(run_dir=tmp_path, model="/m", seed=7, batch_groups=3, torch_threads=2, mode="sync")
    for wide, targets in STACK_WIDE.items():
        for service, setting in targets.items():
            assert config.setting(service, setting) == getattr(config, wide), (wide, service)
    assert config.env_of("rollout")["REIN_GROUPS_PER_STEP"] == config.env_of("collector")["REIN_BATCH_GROUPS"] == "3"
    assert config.env_of("engine")["REIN_MODEL"] == config.env_of("proxy")["REIN_MODEL"] == "/m"


def test_sync_keeps_groups_without_signal_unless_told_otherwise(tmp_path: Path) -> None:
    assert StackConfig(run_dir=tmp_path, mode="sync").setting("collector", "no_signal_groups") == "keep"
    assert StackConfig(run_dir=tmp_path, mode="async").setting("collector", "no_signal_groups") == "drop"
    told = StackConfig(run_dir=tmp_path, mode="sync", services={"collector": {"no_signal_groups": "drop"}})
    assert told.setting("collector", "no_signal_groups") == "drop"
    assert told.env_of("collector")["REIN_NO_SIGNAL_GROUPS"] == "drop"


def test_the_stacks_tuning_is_a_default_a_service_setting_overrides(tmp_path: Path) -> None:
    assert StackConfig(run_dir=tmp_path).env_of("proxy")["REIN_KAFKA__LINGER_MS"] == "20"
    config = StackConfig(run_dir=tmp_path, services={"proxy": {"kafka": {"linger_ms": 0}}})
    assert config.env_of("proxy")["REIN_KAFKA__LINGER_MS"] == "0"


def test_a_typo_a_bad_value_or_a_shared_value_set_per_service_is_refused_at_once(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no service 'trainers'"):
        StackConfig(run_dir=tmp_path, services={"trainers": {"lr": 1e-4}})
    with pytest.raises(SettingsError, match="TrainerSettings has no setting 'learning_rate'"):
        StackConfig(run_dir=tmp_path, services={"trainer": {"learning_rate": 1e-4}})
    with pytest.raises(SettingsError, match="REIN_LR"):
        StackConfig(run_dir=tmp_path, services={"trainer": {"lr": -1.0}})
    with pytest.raises(ValueError, match=r"services\['rollout'\]\['groups_per_step'\]: set StackConfig.batch_groups"):
        StackConfig(run_dir=tmp_path, services={"rollout": {"groups_per_step": 2}})



def test_a_stack_on_shared_infrastructure_names_everything_under_its_namespace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = SharedInfra("127.0.0.1:1", "redis://127.0.0.1:2/0", namespace="s.x")
    config = StackConfig(run_dir=tmp_path, shared_infra=shared)
    assert config.topics.all() == [f"s.x.{t}" for t in Topics().all()]
    assert config.redis_keys.window == "{s.x}:window"
    groups = {"collector": "s.x.rein-collector", "trainer": "s.x.rein-trainer",
              "broadcaster": "s.x.rein-weight-broadcaster", "rollout": "s.x.rein-rollout"}
    credentials = Credentials.new("x")  # what the stack adds to the settings: the services' secrets
    secrets = {"proxy": credentials.proxy_env(), "broadcaster": credentials.broadcaster_env(),
               "rollout": credentials.runner_env()}
    for service in SERVICES:  # what each service makes of its environment
        with monkeypatch.context() as env:
            for name, value in {**secrets.get(service, {}), **config.env_of(service)}.items():
                env.setenv(name, value)
            settings = load(settings_class(service))
        assert settings.topics == config.topics and settings.redis.key_prefix == "s.x", service
        if service in groups:
            assert config.setting(service, CONSUMER_GROUPS[service]) == groups[service]
            assert getattr(settings, CONSUMER_GROUPS[service]) == groups[service]
    assert StackConfig(run_dir=tmp_path).topics == Topics(), "a stack of its own keeps the default names"
    with pytest.raises(ValueError, match="one of each"):
        StackConfig(run_dir=tmp_path, shared_infra=shared, kafka_brokers=3)
