"""Argument types of `rein up` and `make demo`: "no span cap" spelled ``none`` everywhere (also the proxy's variable);
registry choices read on first use."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from ops.args import max_preempts_arg
from services.proxy.settings import ProxySettings
from shared.settings import SettingsError, load

SECRETS = {"REIN_ADMIN_TOKEN": "a" * 32, "REIN_SESSION_KEY_SECRET": "s" * 32, "REIN_RUN_ID": "run",
           "REIN_RUNNER_TOKEN": "r" * 32}


@pytest.fixture(autouse=True)
def _secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize(("text", "value"), [("none", None), ("None", None), ("0", 0), ("2", 2)])
def test_a_count_or_none(text: str, value: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    assert max_preempts_arg(text) == value
    monkeypatch.setenv("REIN_MAX_PREEMPTS", text)
    assert load(ProxySettings).max_preempts == value


@pytest.mark.parametrize("text", ["-1", "two", ""])
def test_anything_else_is_refused(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="a count >= 0 or none"):
        max_preempts_arg(text)
    monkeypatch.setenv("REIN_MAX_PREEMPTS", text)
    with pytest.raises(SettingsError, match="REIN_MAX_PREEMPTS"):
        load(ProxySettings)


def test_the_demo_reads_the_corrections_registry_only_when_a_correction_is_named() -> None:
    """``make demo`` on its defaults does not import torch in its own process for the flag's choices."""
    code = ("import sys, ops.demo; ops.demo.parse_args([]); assert 'torch' not in sys.modules, 'torch imported'; "
            "assert ops.demo.parse_args(['--correction', 'tis']).correction == 'tis'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
