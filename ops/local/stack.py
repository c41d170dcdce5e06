"""The whole rein pipeline as local processes: what ``make demo`` and ``rein up`` start.

One place composes every service's environment from one :class:`StackConfig`, so
the demo, ``rein up`` and the end-to-end test run the same system. Start order:
Kafka + Redis (unless ``StackConfig.shared_infra`` names running ones) -> topics -> trainer
(writes and publishes ``v0``) -> engine (loads ``v0``) -> proxy -> broadcaster -> collectors -> rollout runner.
"""

from __future__ import annotations

import importlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import Enum
from functools import cache
from pathlib import Path
from typing import Any, Literal

from ops.local.credentials import Credentials
from ops.local.launcher import Infra, LaunchError, Service, Stack, deploy_script
from ops.local.ports import free_port
from shared import bus
from shared.names import RedisKeys, Topics, namespaced
from shared.settings import KafkaSettings, ServiceSettings, settings_env
from shared.staleness import WindowSettings

SERVICES: dict[str, str] = {
    "trainer": "services.trainer.settings:TrainerSettings", "engine": "services.engine.settings:EngineSettings",
    "proxy": "services.proxy.settings:ProxySettings",
    "broadcaster": "services.weight_broadcaster.settings:BroadcasterSettings",
    "collector": "services.collector.settings:CollectorSettings",
    "rollout": "services.rollout.settings:RolloutSettings",
}
"""The stack's services by the name :attr:`StackConfig.services` uses, each with the settings class that declares
its knobs (name, type, default, meaning: docs/settings.md); imported when a config is made (the trainer's imports
torch, which the flags of ``make demo`` and ``rein up`` do not need)."""


@cache
def settings_class(service: str) -> type[ServiceSettings]:
    """The settings class of ``service`` (a key of ``SERVICES``)."""
    module, _, name = SERVICES[service].partition(":")
    cls: type[ServiceSettings] = getattr(importlib.import_module(module), name)
    return cls


TUNING: dict[str, dict[str, Any]] = {
    # the proxy's chunks in batches of 20 ms: no agent waits for their acks (only a session's finish does), and
    # fewer, larger produce requests cost the broker and the proxy less CPU per chat call (docs/benchmarks.md)
    "proxy": {"kafka": {"linger_ms": 20}},
    # the collectors read the busy chunk and event topics in fetches of up to 20 ms: fewer fetch requests, at most
    # 20 ms later; the other consumers (manifests, weights) keep Kafka's defaults: their records are few and each is
    # on the path from one training step to the next; idle, a collector's fetch waits for any record instead
    # (shared/bus/consumer.py's fetch_limits), so a quiet stack is not polled 50 times a second
    "collector": {"kafka": {"fetch_min_bytes": 65536, "fetch_max_wait_ms": 20}},
}
"""Settings the local stack gives its services beyond their defaults; :attr:`StackConfig.services` overrides them."""

STACK_WIDE: dict[str, dict[str, str]] = {
    "model": {"trainer": "model", "engine": "model", "proxy": "model"},
    "seed": {"trainer": "seed", "engine": "seed", "rollout": "seed"},
    "torch_threads": {"trainer": "torch_threads", "engine": "torch_threads"},
    "mode": {"rollout": "mode"},
    "batch_groups": {"collector": "batch_groups", "rollout": "groups_per_step"},
}
"""The :class:`StackConfig` fields that are one value in several services: field -> service -> its setting."""


CONSUMER_GROUPS: dict[str, str] = {
    "collector": "consumer_group", "trainer": "consumer_group", "broadcaster": "consumer_group",
    "rollout": "retry_consumer_group",
}
"""Service -> its setting naming the Kafka consumer group it joins (a shared broker's stacks each need their own)."""


@dataclass(frozen=True)
class SharedInfra:
    """A running Kafka and Redis the stack uses instead of starting its own (a test session's): every topic,
    consumer group and Redis key of the stack starts with ``namespace``, so stacks that share them stay apart.
    The stack neither stops them nor can fault them (``Infra.restart`` needs a stack's own); ``rein status
    --run-dir`` reads the namespace from ``stack.json``."""

    kafka_bootstrap: str
    redis_url: str
    namespace: str


@dataclass
class StackConfig:
    """A local run: its shape (replicas, brokers, ports), the values several services must share, and each
    service's own settings by the names its settings class declares (``services``); a knob not given keeps
    that class's default, so none is declared twice."""

    run_dir: Path
    model: str = "tiny"
    """``REIN_MODEL`` of the trainer, engines and proxies: ``tiny``, a Hugging Face directory or a ``.gguf`` file."""
    mode: Literal["async", "sync"] = "async"
    """The rollout runner's ``REIN_MODE`` (sync: it waits for each weight update before the next wave); in sync
    mode the collectors keep groups without signal unless ``services`` says otherwise (a sync wave whose groups
    are dropped tops itself up, one more episode's wait each under environment time: docs/benchmarks.md)."""
    seed: int = 0
    """``REIN_SEED`` of the trainer, engines and rollout runner."""
    batch_groups: int = WindowSettings.model_fields["batch_groups"].default
    """Groups per training batch: the collectors' ``REIN_BATCH_GROUPS`` and a sync wave (``REIN_GROUPS_PER_STEP``)."""
    torch_threads: int = 1
    """``REIN_TORCH_THREADS`` of the trainer and each engine. 1 pins each to a core of its own, as async mode wants
    (both run at once); in sync mode one phase runs at a time, so each may take every core in its turn
    (docs/benchmarks.md, "The fair sync", measures both placements)."""
    services: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Each service's settings by field name (``{"collector": {"keep_versions": 1}, "trainer": {"lr": 2e-5}}``; a
    mapping for a nested model: ``{"proxy": {"kafka": {"linger_ms": 0}}}``), checked against its settings class
    when the config is made; "collector" is every collector. What the fields above share (``STACK_WIDE``) is set
    there, not here."""
    collectors: int = 2
    engines: int = 1
    """Engine replicas. More than one: each registers itself (``REIN_ADVERTISE_URL``), the proxies route to the
    registered engines (``REIN_DISCOVER_ENGINES``) and the broadcaster updates them; none is configured by URL."""
    proxies: int = 1
    """Proxy replicas. More than one: each registers itself (``REIN_ADVERTISE_URL``) so the broadcaster finds
    it, and HAProxy (``deploy/haproxy.sh``) sits in front with session affinity; agents use its URL."""
    kafka_brokers: int = 1
    """Kafka nodes: 1, or a KRaft cluster whose topics are replicated 3 ways with min.insync.replicas 2."""
    redis_failover: bool = False
    """Redis as a primary, two replicas and three Sentinels; every service finds the primary through the
    Sentinels and acts on a window step or a registry entry only once a replica holds it."""
    shared_infra: SharedInfra | None = None
    """Run on this Kafka and Redis (namespaced) instead of starting a broker and a server of its own."""
    partitions: int = 4
    base_port: int = 0
    """First of a block of ports for the services; 0 picks free ports."""
    startup_timeout_s: float = 120.0
    """Bound on each service's start (an HF trainer writes ``v0`` and an HF engine loads it first)."""
    stop_timeout_s: float = 20.0
    """How long stopping services get before SIGKILL (a stopping HF trainer writes its last checkpoint)."""

    def __post_init__(self) -> None:
        for name in self.services:
            if name not in SERVICES:
                raise ValueError(f"services: no service {name!r}; one of {', '.join(SERVICES)}")
        for wide, targets in STACK_WIDE.items():
            for name, setting in targets.items():
                if setting in self.services.get(name, {}):
                    raise ValueError(f"services[{name!r}][{setting!r}]: set StackConfig.{wide} instead")
        if self.shared_infra is not None and (self.kafka_brokers != 1 or self.redis_failover):
            raise ValueError("shared_infra: a stack on a shared Kafka and Redis has one of each, as given")
        for name in SERVICES:
            self.env_of(name)  # every name and value checked now, before anything starts

    def env_of(self, service: str) -> dict[str, str]:
        """The ``REIN_*`` variables of ``service``'s settings given by the stack (:meth:`_given`)."""
        cls = settings_class(service)
        env: dict[str, str] = {}
        for layer in self._given(service):
            env |= settings_env(cls, layer)
        return env

    def setting(self, service: str, name: str) -> Any:
        """The value ``service`` runs with for its setting ``name``: given by the stack, or its class's default."""
        for layer in reversed(self._given(service)):
            if name in layer:
                return layer[name]
        value = settings_class(service).model_fields[name].get_default(call_default_factory=True)
        return value.value if isinstance(value, Enum) else value

    def _given(self, service: str) -> tuple[dict[str, Any], ...]:
        """``service``'s settings the stack gives, each layer overriding the one before: the stack's tuning, the
        shared fields (and, in sync mode, the collectors keeping groups without signal), ``services``."""
        shared = {setting: getattr(self, wide) for wide, targets in STACK_WIDE.items()
                  if (setting := targets.get(service)) is not None}
        if service == "collector" and self.mode == "sync":
            shared["no_signal_groups"] = "keep"
        if self.shared_infra is not None:
            namespace = self.shared_infra.namespace
            shared |= {"topics": self.topics.model_dump(), "redis": {"key_prefix": namespace}}
            if (group := CONSUMER_GROUPS.get(service)) is not None:
                default = settings_class(service).model_fields[group].default
                shared[group] = namespaced(default, namespace)
        return TUNING.get(service, {}), shared, self.services.get(service, {})

    @property
    def topics(self) -> Topics:
        """The topic names the stack's services use."""
        return Topics().under(self.shared_infra.namespace if self.shared_infra else "")

    @property
    def redis_keys(self) -> RedisKeys:
        """The Redis key layout of the stack's services."""
        return RedisKeys() if self.shared_infra is None else RedisKeys(self.shared_infra.namespace)


@dataclass
class LocalStack:
    """A running local system: infrastructure, services, and where each listens."""

    config: StackConfig
    infra: Infra
    stack: Stack
    urls: dict[str, str]
    credentials: Credentials

    def stop(self) -> None:
        try:
            self.stack.stop(self.config.stop_timeout_s)
        finally:
            try:
                if self.config.proxies > 1:
                    deploy_script("haproxy.sh", "stop", str(self.config.run_dir.resolve() / "haproxy"), timeout_s=30)
            finally:
                self.infra.stop()

    @property
    def trainer_metrics(self) -> Path:
        return self.config.run_dir / "trainer" / "metrics.jsonl"


def start(config: StackConfig) -> LocalStack:
    """Start everything; on any failure, stop what was started and re-raise."""
    run_dir = config.run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    shared = config.shared_infra
    infra = (Infra(run_dir / "infra", kafka_bootstrap=shared.kafka_bootstrap, redis_url=shared.redis_url)
             if shared is not None else Infra.start(run_dir / "infra", config.kafka_brokers, config.redis_failover))
    stack = Stack(run_dir)
    credentials = Credentials.new(run_dir.name)
    port = _port_allocator(config.base_port)
    engines = ["engine"] if config.engines == 1 else [f"engine-{i}" for i in range(config.engines)]
    urls = {
        **{name: f"http://127.0.0.1:{port()}" for name in engines},
        **({"proxy": f"http://127.0.0.1:{port()}"} if config.proxies == 1 else
           {f"proxy-{i}": f"http://127.0.0.1:{port()}" for i in range(config.proxies)}),
        "trainer": f"http://127.0.0.1:{port()}",
        "broadcaster": f"http://127.0.0.1:{port()}",
        "rollout": f"http://127.0.0.1:{port()}",
    }
    collector_ports = [port() for _ in range(config.collectors)]
    for i, p in enumerate(collector_ports):
        urls[f"collector-{i}"] = f"http://127.0.0.1:{p}"
    local = LocalStack(config, infra, stack, urls, credentials)
    try:
        bus.ensure_topology(KafkaSettings(bootstrap_servers=infra.kafka_bootstrap), config.topics, config.partitions)
        common = {
            "REIN_KAFKA__BOOTSTRAP_SERVERS": infra.kafka_bootstrap,
            "REIN_REDIS__URL": infra.redis_url,
            "REIN_LOG_JSON": "true",
        }
        if infra.redis_sentinels:
            common |= {"REIN_REDIS__SENTINELS": json.dumps(infra.redis_sentinels), "REIN_REDIS__REPLICAS_ACKED": "1"}
        weights = run_dir / "weights"
        weights.mkdir(exist_ok=True)
        logs = run_dir / "logs"

        def env(service: str, values: dict[str, str]) -> dict[str, str]:
            """What the stack wires (addresses, ports, credentials), then the service's settings."""
            return {**common, **values, **config.env_of(service)}

        def port_of(name: str) -> str:
            return urls[name].rsplit(":", 1)[1]

        def add(name: str, service: str, values: dict[str, str], timeout_s: float = 90) -> None:
            """Start ``name``, one of the stack's ``service`` processes, and wait for its ``/health``."""
            module = SERVICES[service].partition(".settings")[0]
            stack.add(Service(name, module, env(service, values), f"{urls[name]}/health", logs / f"{name}.log"),
                      timeout_s=timeout_s)

        add("trainer", "trainer", {"REIN_WEIGHTS_DIR": str(weights), "REIN_RUN_DIR": str(run_dir / "trainer"),
                                   "REIN_METRICS_PORT": port_of("trainer")}, config.startup_timeout_s)
        v0 = _first_checkpoint(weights, stack, timeout_s=config.startup_timeout_s)
        for name in engines:
            add(name, "engine", {"REIN_PORT": port_of(name), "REIN_WEIGHTS_DIR": str(weights),
                                 "REIN_MODEL_PATH": str(v0),
                                 **({"REIN_ADVERTISE_URL": urls[name]} if config.engines > 1 else {})},
                config.startup_timeout_s)
        # Replicas register themselves: the proxies and the broadcaster find them in Redis.
        engine_urls = json.dumps([urls["engine"]] if config.engines == 1 else [])
        proxy_env = {
            "REIN_ENGINE_URLS": engine_urls,
            "REIN_DISCOVER_ENGINES": str(config.engines > 1).lower(),
            **credentials.proxy_env(),
        }
        if config.proxies == 1:
            add("proxy", "proxy", {**proxy_env, "REIN_PORT": port_of("proxy")}, config.startup_timeout_s)
        else:
            replicas = [f"proxy-{i}" for i in range(config.proxies)]
            for name in replicas:
                add(name, "proxy", {**proxy_env, "REIN_PORT": port_of(name), "REIN_ADVERTISE_URL": urls[name]},
                    config.startup_timeout_s)
            deploy_script("haproxy.sh", "install", timeout_s=900)
            balancer = deploy_script("haproxy.sh", "start", str(run_dir / "haproxy"),
                                     *(urls[n].removeprefix("http://") for n in replicas))
            urls["proxy"] = balancer["url"]
        add("broadcaster", "broadcaster", {
            # Replicas register themselves: the broadcaster finds them in Redis.
            "REIN_PROXY_URLS": json.dumps([urls["proxy"]] if config.proxies == 1 else []),
            "REIN_ENGINE_URLS": engine_urls, **credentials.broadcaster_env(),
            "REIN_METRICS_PORT": port_of("broadcaster"),
        })
        for i in range(config.collectors):
            add(f"collector-{i}", "collector", {"REIN_REPLICA_ID": f"collector-{i}",
                                                 "REIN_METRICS_PORT": port_of(f"collector-{i}")})
        add("rollout", "rollout", {"REIN_PROXY_URL": urls["proxy"], **credentials.runner_env(),
                                   "REIN_METRICS_PORT": port_of("rollout")})
        (run_dir / "stack.json").write_text(
            json.dumps(
                {"config": asdict(config), "urls": urls, "infra": asdict(infra),
                 "admin_token": credentials.admin_token, "credentials": asdict(credentials)},
                indent=2,
                default=str,
            )
        )
        (run_dir / "stack.json").chmod(0o600)  # holds the deployment's secrets
    except BaseException:
        local.stop()
        raise
    return local


def _port_allocator(base: int, choose: Callable[[], int] = free_port) -> Callable[[], int]:
    """The stack's ports: ``base``, ``base + 1``, ...; with ``base`` 0, free ones, never one handed out before.
    A port is bound only once its service starts, so a second free choice can return the first again (two
    services on one port: one dies with EADDRINUSE)."""
    counter = iter(range(base, base + 100)) if base else None
    given: set[int] = set()

    def next_port() -> int:
        if counter is not None:
            return next(counter)
        for _ in range(100):
            if (port := choose()) not in given:
                given.add(port)
                return port
        raise RuntimeError(f"no free port but the {len(given)} this stack was given")

    return next_port


def _first_checkpoint(weights: Path, stack: Stack, timeout_s: float) -> Path:
    """The trainer's step-0 checkpoint, once its sidecar ``v0.json`` (the commit point) exists.

    The sidecar names the checkpoint (``v0.pt`` for the tiny policy, the directory ``v0`` for an
    HF model), so the engine starts on exactly what the trainer wrote, whatever the family.
    """
    sidecar = weights / "v0.json"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sidecar.exists():
            try:
                return Path(json.loads(sidecar.read_text())["path"])
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise LaunchError(f"{sidecar} names no checkpoint: {exc}") from exc
        dead = stack.dead()
        if dead:
            raise LaunchError(f"{dead[0].name} exited before {sidecar.name} appeared; see {dead[0].log_path}")
        time.sleep(0.2)
    raise LaunchError(f"{sidecar} did not appear within {timeout_s}s")
