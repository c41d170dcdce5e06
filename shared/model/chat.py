"""What the proxy knows of a model: its tokenizer and chat template (:class:`ChatTokenizer`), pure.

Split from :mod:`shared.model.base` (which adds weights and checkpoints) so that the proxy's session
machine reaches neither torch nor a checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from shared.model.reasoning import Reasoning
from shared.model.tool_calls import ToolCallFormat

__all__ = ["ChatTokenizer", "Messages", "ModelError", "Tools", "Turn", "UnrenderableMessages"]


class ModelError(ValueError):
    """A model spec names nothing loadable (unknown family, missing directory, bad GGUF)."""


class UnrenderableMessages(ValueError):
    """Messages a chat template cannot render; ``field`` names the culprit as a request path (``messages.0.role``)."""

    def __init__(self, message: str, field: str = "messages") -> None:
        super().__init__(message)
        self.field = field


Messages = Sequence[Mapping[str, Any]]
"""OpenAI chat messages as plain dicts (role, content, tool_calls, tool_call_id), passed to the template."""

Tools = Sequence[Mapping[str, Any]] | None
"""A request's ``tools`` (OpenAI function specs), rendered by the template; None: the request has none."""

Turn = tuple[Sequence[int], Sequence[int]]
"""One call of a conversation as the engine saw it: the ids a tokenizer rendered (``context``), then
the ids the engine sampled after them, verbatim (``sampled``; a stop id at the end included)."""


class ChatTokenizer(Protocol):
    """A model's tokenizer and chat template, as the proxy and engine use it."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    @property
    def stop_ids(self) -> frozenset[int]:
        """EOS and end-of-turn ids: generation stops after sampling one (it is kept in the output)."""
        ...

    @property
    def tool_call_format(self) -> ToolCallFormat:
        """How the model writes tool calls, as its chat template shows (:mod:`shared.model.tool_calls`)."""
        ...

    @property
    def reasoning(self) -> Reasoning | None:
        """How the model marks its thinking, as its chat template shows (:mod:`shared.model.reasoning`);
        None for a model that does not think aloud."""
        ...

    def encode_chat(self, messages: Messages, *, add_generation_prompt: bool, tools: Tools = None) -> list[int]:
        """Ids of ``messages`` rendered by the model's own chat template (:class:`UnrenderableMessages`
        for messages it cannot render). Message text is text: a special token spelled in it (``<|im_end|>``
        in a tool's result) is encoded as its characters, never as the token, so only the template's
        own markers are special ids."""
        ...

    def continue_chat(self, turns: Sequence[Turn], messages: Messages, *, tools: Tools = None) -> list[int] | None:
        """The ids to append to ``turns`` (their ids in order) so that the whole stands for ``messages``
        followed by the generation prompt; None when ``messages`` do not extend what ``turns`` stand for.

        ``turns`` is a conversation this tokenizer rendered plus what the engine sampled, never
        re-tokenized. Each turn's sampled ids stand for the assistant message an agent was answered:
        :meth:`decode` of them, closed by the template's end of turn when they end with a stop id (any
        stop id: a reply cut by its budget has none, and the template closes it in the returned ids).
        None (the agent edited or dropped history, or the template now renders the earlier messages
        differently) means: start over with :meth:`encode_chat`. Raises as :meth:`encode_chat` does.
        """
        ...

    def append_chat(
        self, turns: Sequence[Turn], messages: Messages, new_from: int, *, tools: Tools = None
    ) -> list[int] | None:
        """The ids of ``messages[new_from:]`` and the generation prompt as the template renders them after the
        earlier messages, to append to ``turns`` whatever the template now renders for those (a template that
        rewrites history, as Qwen3's drops earlier turns' thinking): the engine keeps seeing its own ids
        verbatim. The delta starts where the last turn ends (after its end-of-turn marker when its sampled
        ids end with a stop id, at the marker otherwise). None when the new messages' rendering cannot be
        told apart. Raises as :meth:`encode_chat` does."""
        ...

    def call_opener(self, fmt: ToolCallFormat, name: str | None = None) -> list[int] | None:
        """Ids that open a tool call in ``fmt`` as this family writes it (:func:`~shared.model.tool_calls.call_opener`;
        with ``name``, that function's call up to its arguments), to be appended after the generation prompt
        as context the engine did not sample; None when the family writes no calls in ``fmt``. A special
        token spelled in ``name`` is text."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` without special tokens: what an agent is answered for sampled ids."""
        ...
