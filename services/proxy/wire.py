"""What a wire is: one API dialect's route, spoken as a thin adapter onto the one chat call.

A wire parses its request into the chat-completions request the session machine serves and writes the
finished ``chat.completion`` body back in its own shape (whole, streamed, or failed after the stream
began), and answers errors in its clients' shape. Nothing about staleness, sessions or engines is a
wire's business. The wires the proxy serves are registered in :mod:`services.proxy.wires`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from pydantic import BaseModel, ValidationError

from shared.errors import InvalidRequest

if TYPE_CHECKING:  # openai_api defines a wire itself
    from services.proxy.openai_api import ChatRequest

B = TypeVar("B", bound=BaseModel)


class Call(NamedTuple):
    """One chat call as a wire speaks it: the chat-completions request it asks for, and how the finished
    ``chat.completion`` body is answered whole, streamed, or (after the stream began) failed."""

    chat: ChatRequest
    answer: Callable[[dict[str, Any]], dict[str, Any]]
    frames: Callable[[dict[str, Any]], Iterator[str]]
    error_frame: Callable[[dict[str, Any], int], str]
    """rein's detail of the error and its HTTP status (which the stream, already 200, can no longer carry)."""


@dataclass(frozen=True)
class Wire:
    """A route the proxy serves (``POST route``, and under a session's base URL) and how it is spoken."""

    route: str
    """``/v1/...``: the path its clients call; ``/sessions/{key}`` before it is the same route by session key."""
    call: Callable[[bytes], Call]
    """The request body (JSON) as a :class:`Call`; a body that does not parse is an ``InvalidRequest``."""
    error_body: Callable[[dict[str, Any], int], dict[str, Any]]
    """An error on this route: rein's detail and the HTTP status -> the body its clients read."""

    def __post_init__(self) -> None:
        if not self.route.startswith("/v1/"):  # where a session's base URL ends (services.proxy.middleware)
            raise ValueError(f"a wire's route is under /v1/, not {self.route!r}")


def parse(model: type[B], raw: bytes, empty_ok: bool = False) -> B:
    """Validate a JSON body; 422 naming each bad field."""
    if empty_ok and not raw.strip():
        return model.model_validate({})
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: absurdly nested JSON
        fields = [{"field": "body", "message": str(exc)}]
        raise InvalidRequest(f"body is not valid JSON: {exc}", fields=fields) from None
    return validate(model, data)


def validate(model: type[B], data: Any) -> B:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        fields = [{"field": ".".join(str(p) for p in err["loc"]) or "body", "message": err["msg"]}
                  for err in exc.errors()]
        names = ", ".join(f["field"] for f in fields)
        raise InvalidRequest(f"invalid request body: {names}", fields=fields) from None
