"""The tiny policy's tokenizer and chat template behind the :class:`ChatTokenizer` protocol, without torch:
the proxy needs only this of the tiny family (:func:`shared.model.load_tokenizer`)."""

from __future__ import annotations

from collections.abc import Sequence

from shared.model.chat import Messages, Tools, Turn, UnrenderableMessages
from shared.model.reasoning import Reasoning
from shared.model.tool_calls import ToolCallFormat
from shared.tokenizer import ROLE_TOKENS, TOKENIZER, Tokenizer


class TinyChatTokenizer:
    """:class:`shared.tokenizer.Tokenizer` behind the :class:`ChatTokenizer` protocol.

    The tiny template has no tool rendering: ``tools`` are ignored, and a message's
    ``content`` must be text (None reads as empty).
    """

    def __init__(self, tokenizer: Tokenizer = TOKENIZER) -> None:
        self.inner = tokenizer

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    @property
    def pad_id(self) -> int:
        return self.inner.pad_id

    @property
    def stop_ids(self) -> frozenset[int]:
        return frozenset({self.inner.end_id})

    @property
    def tool_call_format(self) -> ToolCallFormat:
        """The tiny policy writes no tool calls."""
        return ToolCallFormat.NONE

    @property
    def reasoning(self) -> Reasoning | None:
        """The tiny policy does not think aloud."""
        return None

    def encode_chat(self, messages: Messages, *, add_generation_prompt: bool, tools: Tools = None) -> list[int]:
        plain = []
        for i, message in enumerate(messages):
            if "role" not in message or "content" not in message:
                missing = "role" if "role" not in message else "content"
                raise UnrenderableMessages(f"message {i} lacks field {missing!r}", f"messages.{i}.{missing}")
            if message["role"] not in ROLE_TOKENS:
                raise UnrenderableMessages(f"messages.{i}.role: the tiny model's template has no role "
                                           f"{message['role']!r}; it takes {sorted(ROLE_TOKENS)}", f"messages.{i}.role")
            content = message["content"]
            plain.append({"role": str(message["role"]), "content": "" if content is None else str(content)})
        return self.inner.apply_chat_template(plain, add_generation_prompt=add_generation_prompt)

    def continue_chat(self, turns: Sequence[Turn], messages: Messages, *, tools: Tools = None) -> list[int] | None:
        """In id space: the tiny template renders each message on its own, so ``turns`` must equal
        the rendering of ``messages`` up to some point and the rest is the delta. Sampled ids stand
        for their text (special ids dropped, as :meth:`decode` drops them) plus ``<|end|>`` when the
        engine stopped on it; a reply cut by its budget gets ``<|end|>`` first in the delta."""
        full = self.encode_chat(messages, add_generation_prompt=True, tools=tools)
        pos = 0
        for context, sampled in turns:
            expected = [*context, *self._answer_ids(sampled)]
            if full[pos : pos + len(expected)] != expected:
                return None
            pos += len(expected)
        return full[pos:] if turns and pos < len(full) else None

    def _answer_ids(self, sampled: Sequence[int]) -> list[int]:
        """The ids the template renders for the assistant message :meth:`decode` makes of ``sampled``."""
        end = self.inner.end_id
        stopped = bool(sampled) and sampled[-1] == end
        words = [i for i in sampled if not self.inner.is_special(i)]
        return [*words, end] if stopped else words

    def append_chat(
        self, turns: Sequence[Turn], messages: Messages, new_from: int, *, tools: Tools = None
    ) -> list[int] | None:
        """The tiny template never rewrites history: whatever :meth:`continue_chat` could not continue, this
        cannot either."""
        return None

    def call_opener(self, fmt: ToolCallFormat, name: str | None = None) -> list[int] | None:
        """The tiny policy writes no calls: nothing can open one."""
        return None

    def decode(self, ids: Sequence[int]) -> str:
        return self.inner.decode(ids)
