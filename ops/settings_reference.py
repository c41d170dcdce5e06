"""docs/settings.md: every ``REIN_*`` variable, generated from the settings classes.

Each service reads its configuration through one settings class; a field's docstring is its
description, and the type of a field named from a registry (``shared.registry``) is the names
registered. This renders them all (name, type, default, meaning) so the reference cannot drift
from the code: ``tests/unit/ops/test_settings_reference.py`` fails when the file is stale.
Regenerate with ``python -m ops.settings_reference``.
"""

from __future__ import annotations

import enum
import importlib
import json
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from shared.registry import Registry
from shared.settings import ServiceSettings, env_name

DOC = Path(__file__).resolve().parents[1] / "docs" / "settings.md"

SERVICES = (
    ("rollout runner", "python -m services.rollout", "services.rollout.settings:RolloutSettings"),
    ("proxy", "python -m services.proxy", "services.proxy.settings:ProxySettings"),
    ("engine", "python -m services.engine", "services.engine.settings:EngineSettings"),
    ("collector", "python -m services.collector", "services.collector.settings:CollectorSettings"),
    ("trainer", "python -m services.trainer", "services.trainer.settings:TrainerSettings"),
    ("weight broadcaster", "python -m services.weight_broadcaster",
     "services.weight_broadcaster.settings:BroadcasterSettings"),
    ("rein status", "rein status", "ops.status:StatusSettings"),
)
"""``(name, command, module:class)`` of each settings class, in the order the reference lists them."""

HEADER = """\
# Settings: every `REIN_*` variable

Generated from the settings classes by `python -m ops.settings_reference` (do not edit by hand;
`tests/unit/ops/test_settings_reference.py` fails when this file is stale). Each service reads the
variables of its own table and those every service shares; an unknown `REIN_*` variable stops a
service at start (a typo would otherwise pass silently). Nested settings use `__`
(`REIN_KAFKA__BOOTSTRAP_SERVERS`); lists and mappings are JSON (`REIN_REDIS__SENTINELS='["h:26379"]'`).
"""


def _type(annotation: Any) -> str:
    origin = get_origin(annotation)
    if origin is Literal:
        return " \\| ".join(f"`{a}`" for a in get_args(annotation))
    if origin in (Union, types.UnionType):
        return " or ".join(_type(a) for a in get_args(annotation))
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " \\| ".join(f"`{m.value}`" for m in annotation)
    if origin is not None:
        return str(annotation).replace("typing.", "") + " (JSON)"
    if annotation is type(None):
        return "none"
    return annotation.__name__ if isinstance(annotation, type) else str(annotation)


def _default(field: FieldInfo) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, (list, dict, tuple)):
        return f"`{json.dumps(value)}`"
    if value is None:
        return "unset"
    return f"`{value}`" if value != "" else '`""`'


def _text(field: FieldInfo) -> str:
    return " ".join((field.description or "").split()).replace("|", "\\|")


def rows(cls: type[BaseModel], prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, str, str, str]]:
    """``(variable, type, default, meaning)`` of every field of ``cls``, nested models expanded."""
    for name, field in cls.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from rows(ann, (*prefix, name))
            continue
        env = env_name((*prefix, name))
        registry = next((m for m in field.metadata if isinstance(m, Registry)), None)
        kind = " \\| ".join(f"`{n}`" for n in registry) if registry is not None else _type(ann)
        yield env, kind, _default(field), _text(field)


def _table(found: list[tuple[str, str, str, str]]) -> str:
    lines = ["| variable | type | default | meaning |", "|---|---|---|---|"]
    lines += [f"| `{env}` | {kind} | {default} | {text} |" for env, kind, default, text in found]
    return "\n".join(lines)


def _settings_class(path: str) -> type[ServiceSettings]:
    module, _, name = path.partition(":")
    cls: type[ServiceSettings] = getattr(importlib.import_module(module), name)
    return cls


def render() -> str:
    """The whole reference, as docs/settings.md holds it."""
    shared = {env for env, *_ in rows(ServiceSettings)}
    parts = [HEADER, "## Every service\n", _table(list(rows(ServiceSettings))), ""]
    for name, command, path in SERVICES:
        own = [row for row in rows(_settings_class(path)) if row[0] not in shared]
        parts += [f"## {name} (`{command}`)\n", _table(own), ""]
    return "\n".join(parts)


def main() -> int:
    DOC.write_text(render())
    print(f"wrote {DOC}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
