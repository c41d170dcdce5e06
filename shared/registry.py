"""Registries of things that come in families (off-policy corrections, tasks): the one place a member is named.

A :class:`Registry` maps a name (a setting's value, such as ``REIN_TASK``) to its implementation, and is
a plain ``dict``, so registering is one entry. A settings field typed ``Annotated[str, REGISTRY]`` accepts
the names registered when it is validated (the error lists them); ``ops.settings_reference`` and the CLIs'
``choices`` read the same names, so a new member is its implementation plus one registration line.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import GetCoreSchemaHandler
from pydantic_core import CoreSchema, core_schema

T = TypeVar("T")


class Registry(dict[str, T]):
    """Name -> implementation, in registration order (the order settings docs and CLI help list them)."""

    def __init__(self, what: str, members: Mapping[str, T]) -> None:
        super().__init__(members)
        self.what = what
        """What a member is, for errors (``unknown task 'x'; one of ...``)."""

    def check(self, name: str) -> str:
        """``name`` when it is registered; else a ValueError that lists the registered names."""
        if name not in self:
            raise ValueError(f"unknown {self.what} {name!r}; one of {', '.join(self)}")
        return name

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        """As ``Annotated`` metadata: validate a string, then :meth:`check` it (at validation, not import)."""
        return core_schema.no_info_after_validator_function(self.check, handler(source))
