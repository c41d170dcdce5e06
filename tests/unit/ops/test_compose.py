"""docker-compose.yml, Prometheus and Grafana files checked against the services' settings (STYLE 3).

Docker is not needed: the compose file is parsed, its ``${VAR:-default}`` values are
interpolated with the defaults (as ``docker compose`` does with an empty environment),
and each rein service's environment is loaded into that service's settings class.
So a renamed field, a value that no longer parses, a port or topic that drifted, or a
replicated service with a fixed name fails here instead of at ``docker compose up``.
Nothing is skipped: a service whose settings module is missing fails with its name.
"""

from __future__ import annotations

import importlib
import json
import re
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from pydantic import BaseModel
from pydantic_settings import BaseSettings

from shared.names import Topics
from shared.settings import ENV_PREFIX, NESTED_DELIMITER, ServiceSettings, load

REPO = Path(__file__).resolve().parents[3]
COMPOSE = REPO / "docker-compose.yml"
PROMETHEUS = REPO / "deploy" / "prometheus" / "prometheus.yml"
GRAFANA = REPO / "deploy" / "grafana"

REIN_SERVICES = ("engine", "proxy", "collector", "trainer", "weight_broadcaster", "rollout")
"""Compose service name = package under services/ = ``python -m services.<name>``."""
REPLICATED = ("engine", "proxy", "collector", "rollout")
LISTEN_FIELDS = {"engine": ("host", "port"), "proxy": ("host", "port")}
"""Services whose main HTTP server carries /health and /metrics; the others use metrics_host/metrics_port."""

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")
SECRETS = {"ADMIN_TOKEN": "compose-admin-token", "RUNNER_TOKEN": "compose-runner-token",
           "SESSION_KEY_SECRET": "compose-session-key-secret", "RUN_ID": "compose-run",
           "GRAFANA_ADMIN_PASSWORD": "compose-grafana-password"}
"""The deployment's secrets: mandatory (``${NAME:?...}``, no public default), written by deploy/compose-env.sh;
these stand-ins fill them here."""


# --------------------------------------------------------------------------- helpers


def interpolate(value: str, env: dict[str, str] | None = None) -> str:
    """Compose's interpolation: ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``, ``${VAR:?err}``, ``$$``."""
    env = env or {}

    def sub(match: re.Match[str]) -> str:
        name, op, arg = match.group(1), match.group(2), match.group(3)
        if op is None:
            if name not in env:
                raise AssertionError(f"${{{name}}} has no default: `docker compose up` needs it set")
            return env[name]
        if op == ":-":
            return env.get(name) or arg
        if op == "-":
            return env.get(name, arg)
        if op == ":?" and name in SECRETS:
            return env.get(name) or SECRETS[name]
        raise AssertionError(f"${{{name}{op}{arg}}} makes {name} mandatory for every `docker compose up`")

    escaped = value.replace("$$", "\0")
    out = _VAR.sub(sub, escaped)
    stray = re.search(r"\$[A-Za-z_{]", out)
    assert stray is None, f"unsupported or unbraced variable in {value!r}"
    return out.replace("\0", "$")


def _load_yaml(path: Path) -> dict[str, Any]:
    assert path.is_file(), f"{path.relative_to(REPO)} is missing"
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert isinstance(data, dict), f"{path} is not a YAML mapping"
    return data


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return _load_yaml(COMPOSE)


def _service(compose: dict[str, Any], name: str) -> dict[str, Any]:
    services = compose["services"]
    assert name in services, f"docker-compose.yml has no service {name!r} (has {sorted(services)})"
    svc: dict[str, Any] = services[name]
    return svc


def environment(svc: dict[str, Any]) -> dict[str, str]:
    """A service's environment, interpolated with compose's defaults; values must be strings or numbers."""
    raw = svc.get("environment") or {}
    if isinstance(raw, list):
        raw = dict(item.split("=", 1) for item in raw)
    out: dict[str, str] = {}
    for key, value in raw.items():
        assert isinstance(value, str | int | float) and not isinstance(value, bool), (
            f"{key}: {value!r} must be a string (compose rejects YAML booleans and nulls in environment)"
        )
        out[key] = interpolate(str(value))
    return out


def settings_class(name: str) -> type[ServiceSettings]:
    """The one ServiceSettings subclass defined in services/<name>/settings.py."""
    module_name = f"services.{name}.settings"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        pytest.fail(f"{module_name} does not exist ({exc}); docker-compose.yml runs `python -m services.{name}`")
    found = [
        obj
        for obj in vars(module).values()
        if isinstance(obj, type)
        and issubclass(obj, ServiceSettings)
        and obj is not ServiceSettings
        and obj.__module__ == module_name
    ]
    assert len(found) == 1, f"{module_name} should define exactly one ServiceSettings subclass, found {found}"
    return found[0]


def field_path_error(cls: type[BaseModel], key: str) -> str | None:
    """None when ``REIN_A__B`` names a field (``a`` then nested ``b``) of ``cls``; else why not."""
    if not key.startswith(ENV_PREFIX):
        return f"{key} lacks the {ENV_PREFIX} prefix"
    parts = key[len(ENV_PREFIX) :].lower().split(NESTED_DELIMITER)
    model: type[BaseModel] | None = cls
    for i, part in enumerate(parts):
        if model is None or part not in model.model_fields:
            where = model.__name__ if model is not None else "a non-model field"
            known = sorted(model.model_fields) if model is not None else []
            return f"{key}: {part!r} is not a field of {where} (fields: {known})"
        annotation = model.model_fields[part].annotation
        is_model = isinstance(annotation, type) and issubclass(annotation, BaseModel)
        model = annotation if is_model else None
        if i == len(parts) - 1:
            return None
    return None


def load_service_settings(name: str, env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> ServiceSettings:
    """Build the service's settings from exactly ``env`` (the machine's REIN_* variables removed)."""
    import os

    for key in list(os.environ):
        if key.startswith(ENV_PREFIX):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return load(settings_class(name))


def listen(name: str, settings: BaseSettings) -> tuple[str, int]:
    host_field, port_field = LISTEN_FIELDS.get(name, ("metrics_host", "metrics_port"))
    return getattr(settings, host_field), getattr(settings, port_field)


@pytest.fixture(scope="module")
def loaded(compose: dict[str, Any]) -> dict[str, Any]:
    """Every rein service's settings as compose configures them."""
    out: dict[str, Any] = {}
    with pytest.MonkeyPatch.context() as mp:
        for name in REIN_SERVICES:
            out[name] = load_service_settings(name, rein_env(compose, name), mp)
    return out


def rein_env(compose: dict[str, Any], name: str) -> dict[str, str]:
    return {k: v for k, v in environment(_service(compose, name)).items() if k.startswith(ENV_PREFIX)}


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


# --------------------------------------------------------------------------- the compose file


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
    assert "python -m shared.topology --bootstrap kafka:9092 --partitions $$PARTITIONS" in command
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


# --------------------------------------------------------------------------- gpu profile


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


# --------------------------------------------------------------------------- observability


def test_prometheus_scrapes_every_service_on_its_port(compose: dict[str, Any], loaded: dict[str, Any]) -> None:
    config = _load_yaml(PROMETHEUS)
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    for name in REIN_SERVICES:
        assert name in jobs, f"prometheus.yml does not scrape {name}"
        job = jobs[name]
        port = listen(name, loaded[name])[1]
        if name in REPLICATED:
            sd = job["dns_sd_configs"][0]  # every replica, found through compose's DNS
            assert sd["names"] == [name] and sd["port"] == port
        else:
            assert job["static_configs"][0]["targets"] == [f"{name}:{port}"]
    prom = _service(compose, "prometheus")
    assert "./deploy/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prom["volumes"]
    assert prom["profiles"] == ["observability"]


STALENESS_METRICS = (
    "rein_staleness_version_gap_min",
    "rein_staleness_version_gap_max",
    "rein_staleness_version_gap_mean",
    "rein_staleness_version_span_min",
    "rein_staleness_version_span_max",
    "rein_staleness_version_span_mean",
    "rein_staleness_dropped_groups",
    "rein_staleness_partial_rollout_rejected_groups",
    "rein_staleness_partial_rollout_rejected_samples",
    "rein_staleness_current_version_index",
    "rein_staleness_cutoff_version_index",
    "rein_trainer_reward_mean",
    "rein_trainer_train_rollout_logprob_abs_diff",
)


def test_grafana_dashboard_is_provisioned_and_shows_the_staleness_metrics(compose: dict[str, Any]) -> None:
    datasource = _load_yaml(GRAFANA / "provisioning" / "datasources" / "prometheus.yml")["datasources"][0]
    assert urlsplit(datasource["url"]).hostname == "prometheus"
    provider = _load_yaml(GRAFANA / "provisioning" / "dashboards" / "rein.yml")["providers"][0]
    grafana = _service(compose, "grafana")
    mounted = {spec.split(":")[1]: spec.split(":")[0] for spec in grafana["volumes"]}
    assert mounted[provider["options"]["path"]] == "./deploy/grafana/dashboards"
    assert mounted["/etc/grafana/provisioning"] == "./deploy/grafana/provisioning"

    dashboard = json.loads((GRAFANA / "dashboards" / "rein.json").read_text(encoding="utf-8"))
    exprs = " ".join(
        t["expr"] for p in dashboard["panels"] for t in p.get("targets", []) if isinstance(t.get("expr"), str)
    )
    missing = [m for m in STALENESS_METRICS if m not in exprs]
    assert not missing, f"dashboard lacks {missing}"
    uids = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p.get("targets", [])}
    assert uids == {datasource["uid"]}
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


# --------------------------------------------------------------------------- the helpers themselves


@pytest.mark.parametrize(
    ("raw", "env", "expected"),
    [
        ("${A:-x}", {}, "x"),
        ("${A:-x}", {"A": ""}, "x"),
        ("${A-x}", {"A": ""}, ""),
        ("${A:-x}", {"A": "y"}, "y"),
        ('${U:-["http://e:1"]}', {}, '["http://e:1"]'),
        ("for t in $$TOPICS", {}, "for t in $TOPICS"),
        ("plain", {}, "plain"),
    ],
)
def test_interpolate(raw: str, env: dict[str, str], expected: str) -> None:
    assert interpolate(raw, env) == expected


def test_the_secrets_have_no_default_and_the_set_up_writes_each_once(compose: dict[str, Any], tmp_path: Path) -> None:
    """No public default secret: compose refuses to start without them, and deploy/compose-env.sh writes each
    (fresh, 0600), keeps what is there on a second run and makes a new RUN_ID with --new-run."""
    mandatory = set(re.findall(r"\$\{([A-Z_]+):\?", COMPOSE.read_text()))
    assert mandatory == set(SECRETS)
    env = tmp_path / "secrets.env"
    env.write_text("KEEP_VERSIONS=3\n")

    def written() -> dict[str, str]:
        subprocess.run(["bash", str(REPO / "deploy" / "compose-env.sh"), *extra, str(env)], check=True,
                       capture_output=True, timeout=30)
        return dict(line.split("=", 1) for line in env.read_text().splitlines())

    extra: list[str] = []
    first = written()
    assert set(first) == {*SECRETS, "KEEP_VERSIONS"} and (env.stat().st_mode & 0o777) == 0o600
    assert all(len(first[name]) >= 16 for name in SECRETS)
    assert written() == first, "a second run keeps the deployment's secrets"
    extra = ["--new-run"]
    again = written()
    assert again["RUN_ID"] != first["RUN_ID"] and {k: v for k, v in again.items() if k != "RUN_ID"} == {
        k: v for k, v in first.items() if k != "RUN_ID"}
    other = tmp_path / "other.env"
    subprocess.run(["bash", str(REPO / "deploy" / "compose-env.sh"), str(other)], check=True, capture_output=True)
    assert not set(first.values()) & set(dict(line.split("=", 1) for line in other.read_text().splitlines()).values())


@pytest.mark.parametrize("raw", ["${A}", "${A:?set A}", "$A"])
def test_interpolate_refuses_values_compose_would_need_from_the_shell(raw: str) -> None:
    with pytest.raises(AssertionError):
        interpolate(raw)


def test_field_path_error_walks_nested_settings() -> None:
    assert field_path_error(ServiceSettings, "REIN_KAFKA__BOOTSTRAP_SERVERS") is None
    assert field_path_error(ServiceSettings, "REIN_TOPICS__CHUNKS") is None
    assert "not a field" in str(field_path_error(ServiceSettings, "REIN_KAFKA__BOOTSTRAP"))
    assert "not a field" in str(field_path_error(ServiceSettings, "REIN_PORT"))
    assert "not a field" in str(field_path_error(ServiceSettings, "REIN_LOG_LEVEL__X"))
    assert "prefix" in str(field_path_error(ServiceSettings, "KAFKA_NODE_ID"))
