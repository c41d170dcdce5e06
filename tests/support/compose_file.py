"""docker-compose.yml as ``docker compose`` reads it with an empty environment, for the tests that check it
against the services: its ``${VAR:-default}`` values interpolated (the deployment's mandatory secrets filled
with stand-ins), each rein service's environment, and that environment loaded into the service's one
settings class, with the ``REIN_*`` variables of the machine running the tests removed."""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel
from pydantic_settings import BaseSettings

from shared.settings import ENV_PREFIX, ServiceSettings, load, setting_loc

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"

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
    try:
        parts = setting_loc(key)
    except ValueError as exc:
        return str(exc)
    model: type[BaseModel] | None = cls
    for i, part in enumerate(parts):
        if model is None or part not in model.model_fields:
            where = model.__name__ if model is not None else "a non-model field"
            known = sorted(model.model_fields) if model is not None else []
            return f"{key}: {part!r} is not a field of {where} (fields: {known})"
        annotation = model.model_fields[part].annotation
        model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
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


def rein_env(compose: dict[str, Any], name: str) -> dict[str, str]:
    return {k: v for k, v in environment(_service(compose, name)).items() if k.startswith(ENV_PREFIX)}
