"""Typed settings: the only module that reads the environment.

Every service defines one subclass of :class:`ServiceSettings` and builds it once
in its ``__main__`` with :func:`load`. Variables use the ``REIN_`` prefix and
``__`` for nesting (``REIN_KAFKA__BOOTSTRAP_SERVERS``). Unknown keys and invalid
values fail at start with the variable's name, never later in a request path.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from enum import Enum
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.names import Topics

ENV_PREFIX = "REIN_"
NESTED_DELIMITER = "__"


class SettingsError(ValueError):
    """Settings failed validation; the message names the environment variables."""


class KafkaSettings(BaseModel):
    """Where the broker is and how producers and consumers behave."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    bootstrap_servers: str = "127.0.0.1:9092"
    """Comma-separated host:port list of the Kafka brokers."""
    client_id: str = "rein"
    """Prefix of the client id each producer and consumer reports to the broker."""
    request_timeout_ms: int = Field(default=30_000, gt=0)
    """Bound on every broker request, so a dead broker gives an error instead of a hang."""
    max_record_bytes: int = Field(default=16 * 1024 * 1024, gt=0)
    """Largest record a consumer will decode; bigger ones are counted and skipped."""
    linger_ms: int = Field(default=2, ge=0)
    """How long a producer holds a record to batch it with the next ones; its ack comes no sooner."""
    max_block_ms: int = Field(default=30_000, gt=0)
    """Bound on a producer's send waiting for a topic's metadata (a broker not reached yet, a topic
    that does not exist); the record fails after it."""
    fetch_min_bytes: int = Field(default=1, ge=1)
    """Bytes a consumer's fetch waits for (up to ``fetch_max_wait_ms``) before the broker answers: above 1,
    a busy topic is read in fewer, larger fetches (less broker CPU per record), at up to that wait more latency.
    After a poll that returned nothing the consumer fetches 1 byte with a wait of at least 500 ms instead, until
    records flow again: an idle consumer does not poll the broker every ``fetch_max_wait_ms``."""
    fetch_max_wait_ms: int = Field(default=500, ge=0)
    """Longest a fetch waits for ``fetch_min_bytes`` (with 1 byte: for any record at all)."""
    close_timeout_ms: int = Field(default=3_000, ge=0)
    """Bound on a stopping service's last flush and its consumers' leaving their groups: past it, records
    still unacked are dropped (the service exits; their sessions or groups end as lost, as after a crash)."""


class RedisSettings(BaseModel):
    """Shared state store (version registry, window, pending groups)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    url: str = "redis://127.0.0.1:6379/0"
    """redis:// URL of the server (with ``sentinels``: only its database and password count)."""
    key_prefix: str = "rein"
    """Namespace of every key this deployment writes (as a hash tag: one Redis Cluster slot)."""
    socket_timeout_s: float = Field(default=5.0, gt=0)
    """Bound on every Redis call, so a dead server gives an error instead of a hang."""
    sentinels: list[str] = Field(default_factory=list)
    """``host:port`` of Redis Sentinels (``REIN_REDIS__SENTINELS``, a JSON list). Set, the clients ask them
    for the primary of ``sentinel_master`` and ask again after a failover."""
    sentinel_master: str = "rein"
    """The name the Sentinels monitor the primary under."""
    replicas_acked: int = Field(default=0, ge=0)
    """After each write whose effects reach Kafka (a window step, a registry entry), wait until every replica
    in sync holds it, and at least this many (Redis WAIT), and treat fewer as an outage: with replicas, 1,
    so a failover to any of them keeps every decision already acted on. 0: one server, no waiting."""
    replica_ack_timeout_s: float = Field(default=2.0, gt=0)
    """Bound on that wait; below ``socket_timeout_s`` (the wait is one call)."""

    @field_validator("sentinels")
    @classmethod
    def _host_ports(cls, sentinels: list[str]) -> list[str]:
        for entry in sentinels:
            host, sep, port = entry.rpartition(":")
            if not (sep and host and port.isdigit()):
                raise ValueError(f"sentinels: {entry!r} is not host:port")
        return sentinels

    @model_validator(mode="after")
    def _wait_within_a_call(self) -> RedisSettings:
        if self.replicas_acked and self.replica_ack_timeout_s >= self.socket_timeout_s:
            raise ValueError(f"replica_ack_timeout_s ({self.replica_ack_timeout_s}) must be below socket_timeout_s "
                             f"({self.socket_timeout_s}): the wait for replicas is one Redis call")
        return self


class ServiceSettings(BaseSettings):
    """Base of every service's settings: the broker, Redis and topic names."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter=NESTED_DELIMITER,
        extra="forbid",
        validate_default=True,
        use_attribute_docstrings=True,  # each field's docstring is its description (docs/settings.md)
    )

    renamed: ClassVar[dict[str, str]] = {}
    """Variables this service read under another name before (old -> new): set, they stop it with the new name."""

    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    redis: RedisSettings = Field(default_factory=RedisSettings)
    topics: Topics = Field(default_factory=Topics)
    log_level: str = "info"
    """structlog level: debug, info, warning, error."""
    log_json: bool = True
    """JSON lines (services) or a readable console format (CLI, local debugging)."""


class ReplicaSettings(BaseModel):
    """How a replica (a proxy, an engine) registers itself in Redis for the others to find it."""

    model_config = SettingsConfigDict(use_attribute_docstrings=True)  # a mixin of settings classes

    advertise_url: str = ""
    """How the others reach this replica (``http://proxy-2:8000``; ``{ip}`` stands for the address this host's
    name resolves to, as for replicas in compose). Set, the replica registers itself in Redis and renews
    that every ``heartbeat_s``; empty: not registered."""
    heartbeat_s: float = Field(default=2.0, gt=0)
    """How often a registered replica renews its registration."""
    registration_ttl_s: float = Field(default=10.0, gt=0)
    """How long a registration outlives its last renewal: a killed replica drops out this long after it died."""


class StopSettings(BaseModel):
    """How long a service that holds nothing Kafka, Redis or its durable files cannot rebuild may take to stop."""

    model_config = SettingsConfigDict(use_attribute_docstrings=True)  # a mixin of settings classes

    stop_timeout_s: float = Field(default=8.0, gt=0)
    """Bound on a stop (SIGTERM/SIGINT), whatever the service's dependencies do: it finishes what it can (the rollout
    runner drains groups in flight, a collector ends its iteration, the proxy lets calls finish, the broadcaster
    ends its round, the trainer its step) for half of it, closes its clients, and exits once it is spent even if a
    wait on a dead broker is still running (``shared/stopping.py``). What it has not finished is read again or
    retried, as after a crash. Below compose's 30 s grace period, so a stop is never a SIGKILL."""


class ModelServiceSettings(ServiceSettings):
    """Base of the services that hold a model (engine, proxy, trainer): they must agree on it."""

    model: str = "tiny"
    """The model every service serves and trains (``REIN_MODEL``): ``tiny`` (the built-in policy), a path to
    a Hugging Face directory, or a path to a ``.gguf`` file (converted once into the cache; see shared.model)."""


def http_urls(urls: list[str], field: str) -> list[str]:
    """``urls`` stripped of blanks and trailing slashes; a non-http(s) URL or a duplicate (the same
    server twice) is a ``ValueError`` naming ``field``, for the validators of the URL-list settings."""
    cleaned = [u.strip().rstrip("/") for u in urls]
    bad = [u for u in cleaned if not u.startswith(("http://", "https://"))]
    if bad:
        raise ValueError(f"{field} must be http(s) URLs, got {bad}")
    if len(set(cleaned)) != len(cleaned):
        raise ValueError(f"{field} has duplicates: {cleaned}")
    return cleaned


def rein_cache() -> Path:
    """``${REIN_CACHE:-~/.cache/rein}``: converted models, Kafka jars and venvs live here, outside checkouts."""
    import os

    return Path(os.environ.get("REIN_CACHE") or Path.home() / ".cache" / "rein")


S = TypeVar("S", bound=BaseSettings)

NOT_SETTINGS = frozenset({"REIN_CACHE", "REIN_EXTRAS", "REIN_PORT_BLOCK", "REIN_WARM_START"})
"""``REIN_*`` variables read by the deploy scripts or the launcher (``ops/local``), not by any service."""


def unknown_variables(cls: type[BaseSettings], environ: Mapping[str, str]) -> list[str]:
    """``REIN_*`` variables whose first segment is no field of ``cls`` (a typo would pass silently)."""
    fields = {name.upper() for name in cls.model_fields}
    bad = []
    for key in environ:
        upper = key.upper()
        if not upper.startswith(ENV_PREFIX) or upper in NOT_SETTINGS:
            continue
        if upper[len(ENV_PREFIX) :].split(NESTED_DELIMITER)[0] not in fields:
            bad.append(key)
    return sorted(bad)


def env_name(loc: tuple[int | str, ...]) -> str:
    """The environment variable that sets the field at ``loc``."""
    return ENV_PREFIX + NESTED_DELIMITER.join(str(part).upper() for part in loc)


def setting_loc(variable: str) -> tuple[str, ...]:
    """The field path a ``REIN_*`` variable sets (``REIN_KAFKA__LINGER_MS`` -> ``("kafka", "linger_ms")``), the
    inverse of :func:`env_name`; ValueError without the prefix."""
    if not variable.upper().startswith(ENV_PREFIX):
        raise ValueError(f"{variable} lacks the {ENV_PREFIX} prefix")
    return tuple(variable[len(ENV_PREFIX) :].lower().split(NESTED_DELIMITER))


def settings_env(cls: type[BaseModel], values: Mapping[str, Any], loc: tuple[str, ...] = ()) -> dict[str, str]:
    """The ``REIN_*`` variables that give ``cls``'s fields ``values``, by field name (a mapping for a nested
    model: ``{"kafka": {"linger_ms": 20}}``). Each name is checked against the class and each value against its
    field's type here, so whoever composes a service's environment (the local stack) fails on a typo before
    starting anything; None leaves a field whose default is None unset. Cross-field rules are checked by the
    service itself at its start."""
    env: dict[str, str] = {}
    for name, value in values.items():
        where = (*loc, name)
        field = cls.model_fields.get(name)
        if field is None:
            raise SettingsError(f"{cls.__name__} has no setting {name!r} ({env_name(where)}); known: "
                                f"{', '.join(sorted(cls.model_fields))}")
        nested = field.annotation
        if isinstance(value, Mapping) and isinstance(nested, type) and issubclass(nested, BaseModel):
            env |= settings_env(nested, value, where)
            continue
        if value is None and field.default is None:
            continue
        try:
            TypeAdapter(field.rebuild_annotation()).validate_python(value)
        except ValidationError as exc:
            raise SettingsError(f"{env_name(where)}: {exc.errors()[0]['msg']} (got {value!r})") from None
        env[env_name(where)] = _env_text(value)
    return env


def _env_text(value: Any) -> str:
    """A value as pydantic-settings reads it back: JSON for lists, mappings and models, lower-case booleans."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, Enum):
        return str(value.value)
    if isinstance(value, BaseModel):
        return value.model_dump_json()
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value, default=str)
    return str(value)


def load(cls: type[S], **overrides: Any) -> S:
    """Build ``cls`` from the environment (plus explicit overrides) or raise SettingsError.

    The error lists every invalid variable by its environment name, so a typo in a
    compose file is found at start.
    """
    import os

    unknown = unknown_variables(cls, os.environ)
    if unknown:
        renamed: dict[str, str] = getattr(cls, "renamed", {})
        moved = [f"{old} is now {renamed[old.upper()]}" for old in unknown if old.upper() in renamed]
        raise SettingsError(
            f"invalid settings for {cls.__name__}: unknown variable(s) {', '.join(unknown)}"
            + (f" ({'; '.join(moved)})" if moved else "")
            + f"; known: {', '.join(sorted(ENV_PREFIX + name.upper() for name in cls.model_fields))}"
        )
    try:
        return cls(**overrides)
    except ValidationError as exc:
        lines = [f"invalid settings for {cls.__name__}:"]
        for err in exc.errors():
            loc = tuple(err.get("loc", ()))
            lines.append(f"  {env_name(loc)}: {err['msg']} (got {err.get('input')!r})")
        raise SettingsError("\n".join(lines)) from None


def with_env(extra: dict[str, str]) -> dict[str, str]:
    """This process's whole environment plus ``extra`` (for deploy scripts, which read ``REIN_CACHE``)."""
    import os

    return {**os.environ, **extra}


def child_env(overrides: dict[str, str]) -> dict[str, str]:
    """Environment for a service subprocess: this process's variables minus ``REIN_*``, plus ``overrides``.

    Parent ``REIN_*`` variables are dropped because they are per service (``REIN_PORT``
    means something else to each); the launcher sets every service's own explicitly.
    """
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    env.update(overrides)
    return env
