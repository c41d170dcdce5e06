"""A reasoning model's thinking in its reply, per its family's convention, pure.

Qwen3- and DeepSeek-R1-style models open a reply with ``<think>…</think>``; the engines' reasoning parsers
(SGLang's and vLLM's ``--reasoning-parser``) serve the part inside as ``reasoning_content`` and the rest as
the answer. The convention is read from the chat template, like the tool-call convention
(:mod:`shared.model.tool_calls`): a template that writes the end marker is a reasoning model's.

A reply's thinking is the text before the end marker (a leading start marker dropped: DeepSeek-R1's
template opens it in the generation prompt, Qwen3's model writes it); a reply that opens with the start
marker and never closes it (cut by its budget) is all thinking; any other reply has none.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Reasoning:
    """How a family marks its thinking."""

    start: str = "<think>"
    end: str = "</think>"

    def split(self, text: str) -> tuple[str | None, str]:
        """``text`` as (thinking, answer); thinking None when the reply has none."""
        head, marker, tail = text.partition(self.end)
        if marker:
            return head.lstrip().removeprefix(self.start), tail
        if text.lstrip().startswith(self.start):
            return text.lstrip().removeprefix(self.start), ""
        return None, text

    def join(self, thinking: str, answer: str) -> str:
        """The text a reply with ``thinking`` and ``answer`` was (what :meth:`split` splits back)."""
        return f"{self.start}{thinking}{self.end}{answer}"


THINK = Reasoning()


def detect_reasoning(chat_template: str) -> Reasoning | None:
    """The thinking convention a chat template's source shows, if any."""
    return THINK if THINK.end in chat_template else None
