"""docker-compose.yml checked against the services' settings (STYLE 3).

Docker is not needed: the compose file is parsed, its ``${VAR:-default}`` values are
interpolated with the defaults (as ``docker compose`` does with an empty environment),
and each rein service's environment is loaded into that service's settings class.
So a renamed field, a value that no longer parses, a port or topic that drifted, or a
replicated service with a fixed name fails here instead of at ``docker compose up``.
Nothing is skipped: a service whose settings module is missing fails with its name.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from shared.names import Topics
from shared.settings import ENV_PREFIX
from tests.support.compose_file import (
    COMPOSE,
    REIN_SERVICES,
    REPLICATED,
    REPO,
    _service,
    environment,
    field_path_error,
    interpolate,
    listen,
    load_service_settings,
    rein_env,
    settings_class,
)


def _health_url(svc: dict[str, Any], name: str) -> str:
    """The URL a rein service's healthcheck asks: the compose file's one bash HTTP probe, given the URL."""
    check = svc.get("healthcheck")
    assert check and check.get("test"), f"{name} has no healthcheck"
    test = check["test"]
    assert isinstance(test, list) and len(test) == 6, f"{name}: {test}"
    assert test[:3] == ["CMD", "bash", "-c"] and test[3] == http_probe(), f"{name}: not the shared HTTP probe: {test}"
    return str(test[5])


def http_probe() -> str:
    """The compose file's HTTP health probe (``x-http-probe``), as written there (``$$`` not yet interpolated)."""
    return str(yaml.safe_load(COMPOSE.read_text())["x-http-probe"])


def test_compose_has_every_service(compose: dict[str, Any]) -> None:
    expected = {"kafka", "redis", "topics", *REIN_SERVICES, "sglang", "prometheus", "grafana"}
    assert expected <= set(compose["services"]), f"missing: {sorted(expected - set(compose['services']))}"
    for name, svc in compose["services"].items():
        for dep in svc.get("depends_on") or {}:
            assert dep in compose["services"], f"{name} depends on unknown service {dep!r}"


@pytest.mark.parametrize("name", REIN_SERVICES)
def test_rein_service_runs_its_module_from_the_one_image(compose: dict[str, Any], name: str) -> None:
    svc = _service(compose, name)
    assert svc.get("command") == ["python", "-m", f"services.{name}"]
    assert svc.get("image") == "rein:local"
    assert svc.get("restart") == "unless-stopped"
    assert "profiles" not in svc, f"{name} must start with a plain `docker compose up`"
    depends = svc.get("depends_on") or {}
    for infra in ("kafka", "redis", "topics"):
        assert infra in depends, f"{name} should wait for {infra}"
    assert depends["topics"]["condition"] == "service_completed_successfully"
    assert (REPO / "services" / name / "__main__.py").is_file(), f"services/{name}/__main__.py is missing"
    builders = [n for n in REIN_SERVICES if "build" in _service(compose, n)]
    assert builders == ["trainer"], "exactly one service builds rein:local (the others use it)"
    assert _service(compose, "trainer")["build"]["context"] == "."


@pytest.mark.parametrize("name", REIN_SERVICES)
def test_every_rein_variable_is_a_settings_field(compose: dict[str, Any], name: str) -> None:
    cls = settings_class(name)
    env = environment(_service(compose, name))
    problems = [err for key in env if (err := field_path_error(cls, key)) is not None]
    assert not problems, f"{name}:\n" + "\n".join(problems)


@pytest.mark.parametrize("name", REIN_SERVICES)
def test_environment_loads_and_sets_every_required_field(
    compose: dict[str, Any], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = rein_env(compose, name)
    cls = settings_class(name)
    required = [f for f, info in cls.model_fields.items() if info.is_required()]
    missing = [ENV_PREFIX + f.upper() for f in required if ENV_PREFIX + f.upper() not in env]
    assert not missing, f"{name}: required settings not set in docker-compose.yml: {missing}"
    settings = load_service_settings(name, env, monkeypatch)  # raises SettingsError naming bad variables
    assert settings.kafka.bootstrap_servers == "kafka:9092"
    assert settings.redis.url == "redis://redis:6379/0"
    assert settings.log_json is True


@pytest.mark.parametrize("name", REIN_SERVICES)
def test_health_check_matches_the_listening_port(compose: dict[str, Any], loaded: dict[str, Any], name: str) -> None:
    host, port = listen(name, loaded[name])
    assert host == "0.0.0.0", f"{name} binds {host}: other containers and Prometheus could not reach it"
    url = urlsplit(_health_url(_service(compose, name), name))
    assert (url.hostname, url.port, url.path) == ("127.0.0.1", port, "/health")


def test_urls_between_services_point_at_listening_ports(compose: dict[str, Any], loaded: dict[str, Any]) -> None:
    ports = {name: listen(name, s)[1] for name, s in loaded.items()}
    ports["sglang"] = _sglang_port(compose)
    ports["balancer"] = ports["proxy"]  # it forwards to the proxies' port (checked below)
    checked, advertised = 0, set()
    for name in REIN_SERVICES:
        for key, value in rein_env(compose, name).items():
            if key == "REIN_ADVERTISE_URL":  # a replica registers its own address: the port must be the one it binds
                assert urlsplit(value.replace("{ip}", "10.0.0.2")).port == ports[name], (name, value)
                advertised.add(name)
                continue
            if not key.endswith(("_URL", "_URLS")) or key == "REIN_REDIS__URL":
                continue
            urls = json.loads(value) if key.endswith("_URLS") else [value]
            for raw in urls:
                url = urlsplit(raw)
                assert url.hostname in ports, f"{name} {key}: {raw} names no rein service"
                assert url.port == ports[url.hostname], f"{name} {key}: {raw}, but {url.hostname} listens on {ports}"
                checked += 1
    assert checked >= 1  # rollout -> balancer (proxies and engines register)
    assert advertised == {"proxy", "engine"}


def test_proxy_and_broadcaster_agree(loaded: dict[str, Any]) -> None:
    proxy, broadcaster = loaded["proxy"], loaded["weight_broadcaster"]
    assert proxy.admin_token == broadcaster.admin_token
    assert proxy.engine_urls == broadcaster.engine_urls


LOCAL_ENV = REPO / "deploy" / "images" / "local.env"


def _local_images() -> dict[str, str]:
    lines = [line for line in LOCAL_ENV.read_text().splitlines() if line and not line.startswith("#")]
    return dict(line.split("=", 1) for line in lines)


def test_local_images_replace_the_official_ones_through_compose_variables(compose: dict[str, Any]) -> None:
    """deploy/images/local.env swaps images in through variables whose defaults are the official images, so
    the compose test runs the file a user runs; the local Kafka is the version deploy/kafka.sh resolves."""
    local = _local_images()
    text = COMPOSE.read_text()
    for var in local:
        assert re.search(r"\$\{" + var + r":-[^}]+\}", text), f"docker-compose.yml does not read {var} with a default"
    pom = (REPO / "deploy" / "kafka" / "pom.xml").read_text()
    [version] = re.findall(r"<kafka.version>([^<]+)</kafka.version>", pom)
    assert local["KAFKA_IMAGE"].endswith(f":{version}")
    assert interpolate(_service(compose, "kafka")["image"]) == f"apache/kafka:{version}"
    assert interpolate(_service(compose, "trainer")["build"]["args"]["PYTHON_IMAGE"]) == "python:3.11-slim"
    assert "ARG PYTHON_IMAGE=python:3.11-slim" in (REPO / "Dockerfile").read_text()


@pytest.mark.parametrize(("name", "var"), [("kafka", "KAFKA"), ("redis", "REDIS"), ("balancer", "PROXY"),
                                         ("prometheus", "PROMETHEUS"), ("grafana", "GRAFANA")])
def test_host_ports_are_published_on_loopback_and_movable(compose: dict[str, Any], name: str, var: str) -> None:
    """What the host reaches is on 127.0.0.1 only; the compose test moves each port to a free one."""
    [port] = _service(compose, name)["ports"]
    assert re.fullmatch(r"127\.0\.0\.1:\$\{" + var + r"_HOST_PORT:-\d+\}:\d+", port), port


def test_the_balancer_sends_each_session_to_the_proxy_replicas_the_broadcaster_finds(
    compose: dict[str, Any], loaded: dict[str, Any]
) -> None:
    """Agents reach the replicas through HAProxy only; each replica registers the address the broadcaster
    pauses (no fixed list to keep in step with --scale); the balancer's servers are the proxy service's
    DNS name on the proxies' port, with the one affinity configuration deploy/haproxy.sh uses."""
    balancer = _service(compose, "balancer")
    port = loaded["proxy"].port
    script = " ".join(balancer["command"])
    assert f"proxy:{port}" in script and "resolvers" in script and "@SERVERS@" in script
    assert "./deploy/haproxy/rein.cfg.in:/etc/rein/haproxy.cfg.in:ro" in balancer["volumes"]
    assert "@BIND@" in (REPO / "deploy" / "haproxy" / "rein.cfg.in").read_text()
    assert loaded["proxy"].advertise_url == f"http://{{ip}}:{port}"
    assert loaded["weight_broadcaster"].proxy_urls == []
    assert loaded["rollout"].proxy_url == f"http://balancer:{port}"


def test_kafka_advertises_the_published_address_to_the_host(compose: dict[str, Any]) -> None:
    env = _service(compose, "kafka")["environment"]
    [published] = _service(compose, "kafka")["ports"]
    host_side = published.rsplit(":", 1)[0]
    assert f"EXTERNAL://{host_side}" in env["KAFKA_ADVERTISED_LISTENERS"]


def test_kafka_and_redis_addresses_match_the_infrastructure(compose: dict[str, Any]) -> None:
    kafka = environment(_service(compose, "kafka"))
    assert "PLAINTEXT://kafka:9092" in kafka["KAFKA_ADVERTISED_LISTENERS"].split(",")
    assert "PLAINTEXT://:9092" in kafka["KAFKA_LISTENERS"].split(",")
    assert kafka["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert kafka["KAFKA_CONTROLLER_QUORUM_VOTERS"] == f"{kafka['KAFKA_NODE_ID']}@kafka:9093"
    assert kafka["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"
    assert interpolate(_service(compose, "kafka")["image"]).startswith("apache/kafka:4.1.")
    assert interpolate(_service(compose, "redis")["image"]) == "redis:7"
    for name in ("kafka", "redis"):
        assert _service(compose, name).get("healthcheck"), f"{name} needs a healthcheck (services wait on it)"


def test_topics_are_created_by_the_one_topology_with_the_collectors_partition_count(
    compose: dict[str, Any], loaded: dict[str, Any]
) -> None:
    topics = _service(compose, "topics")
    env = environment(topics)
    assert int(env["PARTITIONS"]) == loaded["collector"].topic_partitions
    assert topics["image"] == "rein:local" and topics["restart"] == "no"
    command = " ".join(topics["command"])
    assert "python -m shared.topology --bootstrap $$BOOTSTRAP --partitions $$PARTITIONS" in command
    assert env["BOOTSTRAP"] == environment(_service(compose, "trainer"))["REIN_KAFKA__BOOTSTRAP_SERVERS"]
    for name, settings in loaded.items():
        assert settings.topics == Topics(), f"{name} overrides topic names; the topics service creates the defaults"


@pytest.mark.parametrize("name", REPLICATED)
def test_replicated_services_have_no_fixed_names_or_host_ports(compose: dict[str, Any], name: str) -> None:
    svc = _service(compose, name)
    assert "container_name" not in svc, f"{name} is scaled with --scale; a container_name breaks that"
    assert "ports" not in svc, f"{name} is scaled with --scale; fixed host ports collide"
    assert "hostname" not in svc
    assert "REIN_REPLICA_ID" not in environment(svc), "one REIN_REPLICA_ID for every replica would collide"


def test_no_container_names_anywhere(compose: dict[str, Any]) -> None:
    named = [n for n, svc in compose["services"].items() if "container_name" in svc]
    assert not named, f"container_name set on {named}: compose project names give unique container names"


def test_weights_volume_is_shared_by_trainer_and_engine(compose: dict[str, Any], loaded: dict[str, Any]) -> None:
    declared = set(compose.get("volumes") or {})
    mounts: dict[str, dict[str, str]] = {}
    for name, svc in compose["services"].items():
        for spec in svc.get("volumes") or []:
            source, target = spec.split(":")[:2]
            if not source.startswith((".", "/")):
                assert source in declared, f"{name} mounts undeclared volume {source!r}"
                mounts.setdefault(name, {})[source] = target
    weights_dir = str(loaded["trainer"].weights_dir)
    assert mounts["trainer"]["weights"] == weights_dir
    assert mounts["engine"]["weights"] == str(loaded["engine"].weights_dir)
    assert mounts["trainer"]["runs"] == str(Path(loaded["trainer"].run_dir).parent)
    kafka_dirs = environment(_service(compose, "kafka"))["KAFKA_LOG_DIRS"]
    assert mounts["kafka"]["kafka-data"] == kafka_dirs
    assert "redis-data" in mounts["redis"]


def _sglang_port(compose: dict[str, Any]) -> int:
    command = [interpolate(str(c)) for c in _service(compose, "sglang")["command"]]
    return int(command[command.index("--port") + 1])


def test_gpu_profile_swaps_the_engine_for_sglang(compose: dict[str, Any], loaded: dict[str, Any]) -> None:
    svc = _service(compose, "sglang")
    assert svc["profiles"] == ["gpu"]
    assert interpolate(svc["image"]).startswith("lmsysorg/sglang")
    command = [interpolate(str(c)) for c in svc["command"]]
    assert command[:3] == ["python3", "-m", "sglang.launch_server"]
    for flag in ("--model-path", "--weight-version", "--host", "--port"):
        assert flag in command and command[command.index(flag) + 1], f"sglang needs {flag} VALUE"
    assert command[command.index("--host") + 1] == "0.0.0.0"
    # Same port as the CPU engine, so ENGINE_URLS only changes the host name.
    assert _sglang_port(compose) == listen("engine", loaded["engine"])[1]
    devices = svc["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in d.get("capabilities", []) for d in devices)
    # The proxy must still start when the CPU engine is scaled to 0 under the gpu profile.
    assert _service(compose, "proxy")["depends_on"]["engine"]["required"] is False
    for name in ("proxy", "weight_broadcaster"):
        raw = _service(compose, name)["environment"]["REIN_ENGINE_URLS"]
        assert "${ENGINE_URLS:-" in raw, f"{name}: REIN_ENGINE_URLS must follow the ENGINE_URLS override"
        swapped = json.loads(interpolate(raw, {"ENGINE_URLS": '["http://sglang:30000"]'}))
        assert swapped == [f"http://sglang:{_sglang_port(compose)}"]
