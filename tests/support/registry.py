"""The checks every registry-backed setting shares (``REIN_TASK`` over ``TASKS``, ``REIN_OFFPOLICY_CORRECTION``
over ``CORRECTIONS``): a name registered for one test is a setting, a ``make demo`` choice and a row of the
settings reference, an unknown name is refused with the registered ones listed, and the test's entry is gone
after it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import pytest
from pydantic_settings import BaseSettings

from ops.demo import parse_args
from ops.settings_reference import rows
from shared.settings import SettingsError, load


@dataclass(frozen=True)
class RegisteredChoice:
    """A setting whose values are the names of ``registry``, and ``make demo``'s flag for it."""

    settings: type[BaseSettings]
    field: str
    flag: str
    registry: Mapping[str, object]

    @property
    def variable(self) -> str:
        return f"REIN_{self.field.upper()}"

    def reference_row(self) -> str:
        """The settings reference's cell of allowed values for the setting."""
        return str(next(r for r in rows(self.settings) if r[0] == self.variable)[1])

    def assert_chosen(self, name: str) -> BaseSettings:
        """``name`` is accepted as the setting and as the demo's flag; the settings that took it."""
        settings = load(self.settings, **{self.field: name})
        assert getattr(settings, self.field) == name
        assert getattr(parse_args([self.flag, name]), self.flag.removeprefix("--")) == name
        return settings

    def assert_refused(self, name: str, listed: str) -> None:
        """``name`` is refused by the settings (naming ``listed``, the registered names) and by the demo."""
        with pytest.raises(SettingsError, match=self.variable) as error:
            load(self.settings, **{self.field: name})
        assert f"one of {listed}" in str(error.value)
        with pytest.raises(SystemExit):
            parse_args([self.flag, name])

    def assert_unregistered(self, name: str) -> None:
        """``name`` (a test's entry) is no longer registered, nor accepted as the setting."""
        assert name not in self.registry
        with pytest.raises(SettingsError):
            load(self.settings, **{self.field: name})
