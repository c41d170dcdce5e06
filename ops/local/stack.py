"""The whole rein pipeline as local processes: what ``make demo`` and ``rein up`` start.

One place composes every service's environment from one :class:`StackConfig`, so
the demo, ``rein up`` and the end-to-end test run the same system. Start order:
Kafka + Redis -> topics -> trainer (writes and publishes ``v0``) -> engine (loads
``v0``) -> proxy -> broadcaster -> collectors -> rollout runner.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ops.local.credentials import Credentials
from ops.local.launcher import Infra, LaunchError, Service, Stack, deploy_script
from ops.local.ports import free_port
from shared import bus
from shared.names import Topics
from shared.settings import KafkaSettings

PROXY_KAFKA = {"REIN_KAFKA__LINGER_MS": "20"}
"""The proxy's chunks in batches of 20 ms: no agent waits for their acks (only a session's finish does), and
fewer, larger produce requests cost the broker and the proxy less CPU per chat call (docs/benchmarks.md)."""
COLLECTOR_KAFKA = {"REIN_KAFKA__FETCH_MIN_BYTES": "65536", "REIN_KAFKA__FETCH_MAX_WAIT_MS": "20"}
"""The collectors read the busy chunk and event topics in fetches of up to 20 ms: fewer fetch requests, at
most 20 ms later. The other consumers (manifests, weights) keep Kafka's defaults: their records are few and
each is on the path from one training step to the next."""


@dataclass
class StackConfig:
    """Knobs of a local run; every service gets its settings from these."""

    run_dir: Path
    steps: int = 40
    """Trainer steps before the trainer stops (0 = unbounded)."""
    keep_versions: int = 2
    max_preempts: int | None = 2
    partial_rollout: bool = True
    collectors: int = 2
    group_size: int = 8
    batch_groups: int = 8
    """Groups per training batch (GRPO groups of ``group_size`` episodes)."""
    max_concurrent_groups: int = 16
    mode: str = "async"
    """``async`` or ``sync`` (the runner waits for each weight update before the next wave)."""
    no_signal_groups: str | None = None
    """The collectors' ``REIN_NO_SIGNAL_GROUPS``: ``drop`` or ``keep``; None: ``drop`` in async mode, ``keep`` in
    sync mode. A sync wave whose groups are dropped tops itself up with one more group for each (the runner
    reads the window's count), so its batch still fills; under environment time each top-up round is one
    more episode's wait, so sync keeps them by default (docs/benchmarks.md, "The fair sync")."""
    seed: int = 0
    mask_nonlast_version: bool = True
    """The trainer's ``REIN_NONLAST_VERSION_TOKENS``: ``mask`` when true, ``weight`` (older-version tokens
    trained) when false."""
    pacing: str = "window"
    """The rollout runner's ``REIN_PACING`` (async mode): ``window`` or ``off``."""
    offpolicy_correction: str = "none"
    """The trainer's ``REIN_OFFPOLICY_CORRECTION``."""
    stale_groups: str = "drop"
    """The collectors' ``REIN_STALE_GROUPS``: ``drop`` or ``withhold``."""
    torch_threads: int = 1
    """Torch threads of the trainer and of each engine (``REIN_TORCH_THREADS``). 1 pins each to a core of its
    own, as async mode wants (both run at once); in sync mode one phase runs at a time, so each may take
    every core in its turn (docs/benchmarks.md, "The fair sync", measures both placements)."""
    engine_step_delay_s: float = 0.0
    base_port: int = 0
    """First of a block of ports for the services; 0 picks free ports."""
    partitions: int = 4
    kafka_brokers: int = 1
    """Kafka nodes: 1, or a KRaft cluster whose topics are replicated 3 ways with min.insync.replicas 2."""
    engines: int = 1
    """Engine replicas. More than one: each registers itself (``REIN_ADVERTISE_URL``), the proxies route to the
    registered engines (``REIN_DISCOVER_ENGINES``) and the broadcaster updates them; none is configured by URL."""
    proxies: int = 1
    """Proxy replicas. More than one: each registers itself (``REIN_ADVERTISE_URL``) so the broadcaster finds
    it, and HAProxy (``deploy/haproxy.sh``) sits in front with session affinity; agents use its URL."""
    redis_failover: bool = False
    """Redis as a primary, two replicas and three Sentinels; every service finds the primary through the
    Sentinels and acts on a window step or a registry entry only once a replica holds it."""
    model: str = "tiny"
    """``REIN_MODEL`` of the trainer, engine and proxy: ``tiny``, a Hugging Face directory or a ``.gguf`` file."""
    task: str = "guess_number"
    """``REIN_TASK`` of the rollout runner (``arithmetic`` for an instruct model)."""
    max_tokens: int | None = None
    """Output budget of each assistant reply (``REIN_MAX_TOKENS``); None: the runner's default."""
    lr: float | None = None
    """Trainer learning rate; None: the trainer's default (tuned for the tiny policy)."""
    weight_decay: float | None = None
    """Trainer AdamW weight decay; None: the trainer's default."""
    epochs: int | None = None
    """Trainer optimizer steps per batch (``REIN_EPOCHS``); None: the trainer's default (1)."""
    init_weights: Path | None = None
    """The trainer's ``REIN_INIT_WEIGHTS``: a checkpoint taken as the step-0 weights (a warm start); None: fresh."""
    keep_checkpoints: int = 0
    """Trainer keeps the newest N durable steps (0: all); an HF step is ~0.5 GB of weights plus optimizer state."""
    model_width: int | None = None
    """Width of the tiny policy's step-0 weights (the trainer's ``REIN_MODEL_WIDTH``; the engines load what it
    writes); None: the trainer's default."""
    startup_timeout_s: float = 120.0
    """Bound on each service's start (an HF trainer writes ``v0`` and an HF engine loads it first)."""
    stop_timeout_s: float = 20.0
    """How long stopping services get before SIGKILL (a stopping HF trainer writes its last checkpoint)."""
    extra_env: dict[str, dict[str, str]] = field(default_factory=dict)
    """Per-service extra ``REIN_*`` variables (service name -> variables)."""


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
    infra = Infra.start(run_dir / "infra", config.kafka_brokers, config.redis_failover)
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
        bus.ensure_topology(KafkaSettings(bootstrap_servers=infra.kafka_bootstrap), Topics(), config.partitions)
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

        def env(name: str, values: dict[str, str]) -> dict[str, str]:
            return {**common, **values, **config.extra_env.get(name, {})}

        def port_of(name: str) -> str:
            return urls[name].rsplit(":", 1)[1]

        def optional(values: dict[str, object | None]) -> dict[str, str]:
            return {k: str(v) for k, v in values.items() if v is not None}

        model = {"REIN_MODEL": config.model}

        stack.add(
            Service(
                "trainer",
                "services.trainer",
                env(
                    "trainer",
                    {
                        "REIN_WEIGHTS_DIR": str(weights),
                        "REIN_RUN_DIR": str(run_dir / "trainer"),
                        "REIN_SEED": str(config.seed),
                        "REIN_MAX_STEPS": str(config.steps),
                        "REIN_TORCH_THREADS": str(config.torch_threads),
                        "REIN_NONLAST_VERSION_TOKENS": "mask" if config.mask_nonlast_version else "weight",
                        "REIN_OFFPOLICY_CORRECTION": config.offpolicy_correction,
                        "REIN_METRICS_PORT": port_of("trainer"),
                        "REIN_KEEP_CHECKPOINTS": str(config.keep_checkpoints),
                        **model,
                        **optional({"REIN_LR": config.lr, "REIN_WEIGHT_DECAY": config.weight_decay,
                                    "REIN_EPOCHS": config.epochs, "REIN_INIT_WEIGHTS": config.init_weights,
                                    "REIN_MODEL_WIDTH": config.model_width}),
                    },
                ),
                f"{urls['trainer']}/health",
                logs / "trainer.log",
            ),
            timeout_s=config.startup_timeout_s,
        )
        v0 = _first_checkpoint(weights, stack, timeout_s=config.startup_timeout_s)
        for name in engines:
            stack.add(
                Service(
                    name,
                    "services.engine",
                    env(
                        "engine",
                        {
                            "REIN_PORT": port_of(name),
                            "REIN_WEIGHTS_DIR": str(weights),
                            "REIN_MODEL_PATH": str(v0),
                            "REIN_SEED": str(config.seed),
                            "REIN_TORCH_THREADS": str(config.torch_threads),
                            "REIN_STEP_DELAY_S": str(config.engine_step_delay_s),
                            **model,
                            **({"REIN_ADVERTISE_URL": urls[name]} if config.engines > 1 else {}),
                        },
                    ),
                    f"{urls[name]}/health",
                    logs / f"{name}.log",
                ),
                timeout_s=config.startup_timeout_s,
            )
        # Replicas register themselves: the proxies and the broadcaster find them in Redis.
        engine_urls = json.dumps([urls["engine"]] if config.engines == 1 else [])
        proxy_env = {
            **PROXY_KAFKA,
            "REIN_ENGINE_URLS": engine_urls,
            "REIN_DISCOVER_ENGINES": str(config.engines > 1).lower(),
            **credentials.proxy_env(),
            "REIN_PARTIAL_ROLLOUT": str(config.partial_rollout).lower(),
            **model,
        }
        if config.max_preempts is not None:
            proxy_env["REIN_MAX_PREEMPTS"] = str(config.max_preempts)
        if config.proxies == 1:
            stack.add(
                Service("proxy", "services.proxy", env("proxy", {**proxy_env, "REIN_PORT": port_of("proxy")}),
                        f"{urls['proxy']}/health", logs / "proxy.log"),
                timeout_s=config.startup_timeout_s,
            )
        else:
            replicas = [f"proxy-{i}" for i in range(config.proxies)]
            for name in replicas:
                values = {**proxy_env, "REIN_PORT": port_of(name), "REIN_ADVERTISE_URL": urls[name]}
                stack.add(Service(name, "services.proxy", env("proxy", values), f"{urls[name]}/health",
                                  logs / f"{name}.log"), timeout_s=config.startup_timeout_s)
            deploy_script("haproxy.sh", "install", timeout_s=900)
            balancer = deploy_script("haproxy.sh", "start", str(run_dir / "haproxy"),
                                     *(urls[n].removeprefix("http://") for n in replicas))
            urls["proxy"] = balancer["url"]
        stack.add(
            Service(
                "broadcaster",
                "services.weight_broadcaster",
                env(
                    "broadcaster",
                    {
                        # Replicas register themselves: the broadcaster finds them in Redis.
                        "REIN_PROXY_URLS": json.dumps([urls["proxy"]] if config.proxies == 1 else []),
                        "REIN_ENGINE_URLS": engine_urls,
                        **credentials.broadcaster_env(),
                        "REIN_METRICS_PORT": port_of("broadcaster"),
                    },
                ),
                f"{urls['broadcaster']}/health",
                logs / "broadcaster.log",
            )
        )
        for i in range(config.collectors):
            name = f"collector-{i}"
            stack.add(
                Service(
                    name,
                    "services.collector",
                    env(
                        name,
                        {
                            **COLLECTOR_KAFKA,
                            "REIN_REPLICA_ID": name,
                            "REIN_KEEP_VERSIONS": str(config.keep_versions),
                            "REIN_BATCH_GROUPS": str(config.batch_groups),
                            "REIN_NO_SIGNAL_GROUPS": config.no_signal_groups or (
                                "keep" if config.mode == "sync" else "drop"),
                            "REIN_STALE_GROUPS": config.stale_groups,
                            "REIN_METRICS_PORT": port_of(name),
                        },
                    ),
                    f"{urls[name]}/health",
                    logs / f"{name}.log",
                )
            )
        stack.add(
            Service(
                "rollout",
                "services.rollout",
                env(
                    "rollout",
                    {
                        "REIN_PROXY_URL": urls["proxy"],
                        **credentials.runner_env(),
                        "REIN_SEED": str(config.seed),
                        "REIN_GROUP_SIZE": str(config.group_size),
                        "REIN_MAX_CONCURRENT_GROUPS": str(config.max_concurrent_groups),
                        "REIN_MODE": config.mode,
                        "REIN_PACING": config.pacing,
                        "REIN_GROUPS_PER_STEP": str(config.batch_groups),
                        "REIN_METRICS_PORT": port_of("rollout"),
                        "REIN_TASK": config.task,
                        **optional({"REIN_MAX_TOKENS": config.max_tokens}),
                    },
                ),
                f"{urls['rollout']}/health",
                logs / "rollout.log",
            )
        )
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
