"""The variables of the compose deployment: the tests' copy of compose's interpolation (``${VAR:-default}``
and the forms that would need a value from the shell), the mandatory secrets and deploy/compose-env.sh,
which writes each once, and how a ``REIN_A__B`` variable names a (nested) settings field."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from shared.settings import ServiceSettings
from tests.support.compose_file import COMPOSE, REPO, SECRETS, field_path_error, interpolate


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
