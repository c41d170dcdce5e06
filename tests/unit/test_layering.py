"""Import layering, read from the source with ``ast`` (nothing is imported).

Pure cores stay free of I/O clients, also through what they import from this repository,
so they keep being testable as tables; shared/ imports neither services/ nor ops/; no
service imports another service or ops/. And no module of the product or the benchmarks is longer than
:data:`MAX_MODULE_LINES`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FIRST_PARTY = ("shared", "services", "ops")

IO_CLIENTS = frozenset({"kafka", "redis", "httpx", "fastapi", "uvicorn", "starlette", "openai", "requests", "torch"})
"""Top-level packages a pure module must not reach, directly or through first-party imports."""

PURE: dict[str, frozenset[str]] = {
    "shared/staleness.py": IO_CLIENTS,
    "shared/window_rule.py": IO_CLIENTS,
    "shared/span_cap.py": IO_CLIENTS,
    "shared/version_window.py": IO_CLIENTS,
    "shared/versions.py": IO_CLIENTS,
    "shared/offsets.py": IO_CLIENTS,
    "shared/schemas.py": IO_CLIENTS,
    "shared/codec.py": IO_CLIENTS,
    "shared/names.py": IO_CLIENTS,
    "shared/window_view.py": IO_CLIENTS,
    "shared/lender.py": IO_CLIENTS,
    "shared/registry.py": IO_CLIENTS,
    "services/collector/assembly.py": IO_CLIENTS,
    "services/trainer/ordering.py": IO_CLIENTS,
    "services/trainer/samples.py": IO_CLIENTS,
    "services/trainer/loss.py": IO_CLIENTS - {"torch"},  # the loss is torch arithmetic, no I/O
    "services/trainer/corrections.py": IO_CLIENTS - {"torch"},
    "services/weight_broadcaster/decide.py": IO_CLIENTS,
    "services/rollout/scheduler.py": IO_CLIENTS,
    "services/rollout/task.py": IO_CLIENTS,
    "services/rollout/tasks.py": IO_CLIENTS,
    "services/proxy/responses_api.py": IO_CLIENTS,
    "services/proxy/messages_api.py": IO_CLIENTS,
    "services/proxy/wire.py": IO_CLIENTS,
    "services/proxy/wires.py": IO_CLIENTS,
    "services/proxy/auth.py": IO_CLIENTS,
    "services/proxy/session_machine.py": IO_CLIENTS,
    "services/proxy/session_snapshot.py": IO_CLIENTS,
    "services/proxy/replies.py": IO_CLIENTS,
    "services/proxy/sessions.py": IO_CLIENTS,
    "services/proxy/transcript.py": IO_CLIENTS,
    "shared/model/chat.py": IO_CLIENTS,
    "shared/model/tiny_chat.py": IO_CLIENTS,
    "shared/model/plain_messages.py": IO_CLIENTS,
    "services/proxy/session_keys.py": IO_CLIENTS,
}


def _imports(path: Path) -> set[str]:
    """Dotted names of every module ``path`` imports, at any depth (function-level imports too)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)  # `from shared import bus`
    return names


def _source(module: str) -> Path | None:
    """The file of a first-party module, or None (third party, or a name imported from a module)."""
    base = REPO.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _reach(path: Path) -> dict[str, str]:
    """Every module imported from ``path``, directly or through first-party modules -> the file importing it."""
    seen: dict[str, str] = {}
    todo = [path]
    visited: set[Path] = set()
    while todo:
        current = todo.pop()
        if current in visited:
            continue
        visited.add(current)
        for name in _imports(current):
            seen.setdefault(name, str(current.relative_to(REPO)))
            source = _source(name) if name.split(".")[0] in FIRST_PARTY else None
            if source is not None:
                todo.append(source)
    return seen


def _python_files(package: str) -> list[Path]:
    return sorted(p for p in (REPO / package).rglob("*.py") if "__pycache__" not in p.parts)


def test_the_pure_modules_exist() -> None:
    missing = [name for name in PURE if not (REPO / name).is_file()]
    assert missing == [], f"listed as pure but not found (moved? update PURE): {missing}"


@pytest.mark.parametrize("module", sorted(PURE))
def test_pure_module_reaches_no_io_client(module: str) -> None:
    reached = _reach(REPO / module)
    bad = {name: via for name, via in reached.items() if name.split(".")[0] in PURE[module]}
    assert bad == {}, f"{module} reaches I/O clients (module -> importing file): {bad}"


def test_the_check_sees_a_banned_import(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("import json\n\ndef f() -> None:\n    from redis import Redis\n")
    assert {"json", "redis", "redis.Redis"} <= _imports(sample)


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [("shared", ("services", "ops")), ("services", ("ops",))],
)
def test_package_layering(package: str, forbidden: tuple[str, ...]) -> None:
    bad = {
        str(path.relative_to(REPO)): sorted(n for n in _imports(path) if n.split(".")[0] in forbidden)
        for path in _python_files(package)
    }
    assert {k: v for k, v in bad.items() if v} == {}


def test_no_service_imports_another() -> None:
    bad: dict[str, list[str]] = {}
    for path in _python_files("services"):
        parts = path.relative_to(REPO).parts
        if len(parts) < 3:
            continue
        own = parts[1]
        others = sorted(
            n for n in _imports(path) if n.startswith("services.") and n.split(".")[1] != own
        )
        if others:
            bad[str(path.relative_to(REPO))] = others
    assert bad == {}


MAX_MODULE_LINES = 400
"""A module longer than this holds more than one job: split it along its seams."""


def test_no_module_is_over_the_line_limit() -> None:
    long = {str(path.relative_to(REPO)): n for package in (*FIRST_PARTY, "bench") for path in _python_files(package)
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}, f"modules over {MAX_MODULE_LINES} lines: {long}"
