"""The compose tests' fixtures: ``compose``, docker-compose.yml parsed, and ``loaded``, every rein service's
settings as that file configures them (``tests/support/compose_file.py``), each made once per test module."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.compose_file import COMPOSE, REIN_SERVICES, _load_yaml, load_service_settings, rein_env


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return _load_yaml(COMPOSE)


@pytest.fixture(scope="module")
def loaded(compose: dict[str, Any]) -> dict[str, Any]:
    """Every rein service's settings as compose configures them."""
    out: dict[str, Any] = {}
    with pytest.MonkeyPatch.context() as mp:
        for name in REIN_SERVICES:
            out[name] = load_service_settings(name, rein_env(compose, name), mp)
    return out
