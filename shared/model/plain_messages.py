"""Request messages in the plain form a chat template renders, and tools for templates that know none.

Pure (no tokenizer): :class:`~shared.model.hf_chat.HFChatTokenizer` folds content parts into text and, for a
template that ignores ``tools``, the tools into the system message and each call into its content.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence
from typing import Any


def text_of(content: Any) -> str:
    """A message's content as text: None is empty, a list of parts is its text parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping) and p.get("type") == "text")
    return str(content)


def tool_call_text(call: Mapping[str, Any]) -> str:
    """A call as the ``<tool_call>{json}</tool_call>`` line folded into an assistant's content."""
    fn = call.get("function", call)
    args = fn.get("arguments", {}) if isinstance(fn, Mapping) else {}
    if isinstance(args, str):
        with contextlib.suppress(ValueError):
            args = json.loads(args)
    name = fn.get("name", "") if isinstance(fn, Mapping) else ""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + "\n</tool_call>"


TOOLS_PROMPT = (
    "You are an expert in composing functions. You are given a question and a set of possible functions.\n"
    "Based on the question, you will need to make one or more function/tool calls to achieve the purpose.\n"
    "If none of the functions can be used, point it out and refuse to answer.\n"
    "If the given question lacks the parameters required by the function, also point it out.\n"
    "You have access to the following tools:\n<tools>{tools}</tools>\n"
    "The output MUST strictly adhere to the following format, and NO other text MUST be included.\n"
    "The example format is as follows. Please make sure the parameter type is correct. If no function call is "
    "needed, please make the tool calls an empty list '[]'.\n"
    '<tool_call>[\n{{"name": "func_name1", "arguments": {{"argument1": "value1", "argument2": "value2"}}}},\n'
    "(more tool calls as required)\n]</tool_call>"
)
"""The system prompt SmolLM2-Instruct was trained to call tools with (its model card and Ollama template):
tools as JSON inside ``<tools>``, calls as a JSON array inside ``<tool_call>``. For a template that
ignores ``tools`` it is the system message's start, so the model sees the tools it is offered."""


def with_tools_prompt(plain: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``plain`` with :data:`TOOLS_PROMPT` for ``tools`` opening the system message (the agent's own
    system text, if any, follows it after a blank line)."""
    prompt = TOOLS_PROMPT.format(tools=json.dumps([dict(t) for t in tools], ensure_ascii=False))
    if plain and plain[0].get("role") == "system":
        own = text_of(plain[0].get("content"))
        return [{**plain[0], "content": f"{prompt}\n\n{own}" if own else prompt}, *plain[1:]]
    return [{"role": "system", "content": prompt}, *plain]


def with_parsed_arguments(call: Mapping[str, Any]) -> dict[str, Any]:
    """``call`` with its JSON-string arguments parsed, as templates that know tools expect them."""
    out = dict(call)
    fn = call.get("function")
    if isinstance(fn, Mapping) and isinstance(fn.get("arguments"), str):
        with contextlib.suppress(ValueError):
            out["function"] = {**fn, "arguments": json.loads(fn["arguments"])}
    return out
