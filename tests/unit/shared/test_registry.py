"""A registry as a settings field's type: names checked at validation, errors that list them."""

from __future__ import annotations

from typing import Annotated

import pytest
from pydantic import BaseModel, ValidationError

from shared.registry import Registry


def test_a_field_accepts_the_names_registered_when_it_is_validated() -> None:
    colours = Registry("colour", {"red": 1, "green": 2})

    class Paint(BaseModel):
        colour: Annotated[str, colours] = "red"

    assert Paint(colour="green").colour == "green"
    with pytest.raises(ValidationError, match="unknown colour 'blue'; one of red, green"):
        Paint(colour="blue")
    colours["blue"] = 3  # registered after the class was built
    assert Paint(colour="blue").colour == "blue"


def test_check_returns_a_registered_name() -> None:
    registry = Registry("task", {"a": None})
    assert registry.check("a") == "a"
    with pytest.raises(ValueError, match="unknown task 'b'; one of a"):
        registry.check("b")
