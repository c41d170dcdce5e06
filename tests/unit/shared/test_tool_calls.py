"""Tool calls parsed from generated text, a table per convention."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.model.tool_calls import ParsedReply, ToolCall, ToolCallFormat, detect_format, parse_reply

H, L, M, P = ToolCallFormat.HERMES, ToolCallFormat.LLAMA3_JSON, ToolCallFormat.MISTRAL, ToolCallFormat.PYTHONIC


def call(name: str, **arguments: object) -> ToolCall:
    return ToolCall(name, json.dumps(arguments))


CASES: list[tuple[str, ToolCallFormat, str, ParsedReply | None]] = [
    # hermes / Qwen
    ("plain text", H, "The answer is 4.", ParsedReply("The answer is 4.")),
    ("one call", H, '<tool_call>\n{"name": "calc", "arguments": {"expr": "2+2"}}\n</tool_call>',
     ParsedReply("", (call("calc", expr="2+2"),))),
    ("text around", H, 'Let me add.\n<tool_call>{"name": "calc", "arguments": {"x": 1}}</tool_call>\nDone',
     ParsedReply("Let me add.\nDone", (call("calc", x=1),))),
    ("parallel", H, '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
                    '<tool_call>{"name": "b", "arguments": {"y": "2"}}</tool_call>',
     ParsedReply("", (call("a"), call("b", y="2")))),
    ("smollm2 array", H,
     '<tool_call>[{"name": "a", "arguments": {"q": 1}}, {"name": "b", "arguments": {}}]</tool_call>',
     ParsedReply("", (call("a", q=1), call("b")))),
    ("arguments as a JSON string", H, '<tool_call>{"name": "a", "arguments": "{\\"q\\": 1}"}</tool_call>',
     ParsedReply("", (call("a", q=1),))),
    ("no arguments field", H, '<tool_call>{"name": "now"}</tool_call>', ParsedReply("", (call("now"),))),
    ("unicode kept", H, '<tool_call>{"name": "say", "arguments": {"t": "héllo"}}</tool_call>',
     ParsedReply("", (ToolCall("say", '{"t": "héllo"}'),))),
    # hermes: malformed or partial -> the whole text is content
    ("bad json", H, 'x <tool_call>{"name": "a", "arguments": {</tool_call>', None),
    ("cut inside a call", H, 'x <tool_call>{"name": "a", "argu', None),
    ("one good one cut", H, '<tool_call>{"name": "a"}</tool_call><tool_call>{"na', None),
    ("stray close", H, 'x </tool_call>', None),
    ("not a call", H, '<tool_call>{"answer": 4}</tool_call>', None),
    # SmolLM2's tools prompt: "If no function call is needed, please make the tool calls an empty list '[]'"
    ("empty array: no call", H, '<tool_call>[]</tool_call>', ParsedReply("", empty=True)),
    ("an answer, then no call", H, 'It is 4.\n<tool_call>[]</tool_call>', ParsedReply("It is 4.", empty=True)),
    ("a call beside an empty list", H, '<tool_call>[]</tool_call><tool_call>{"name": "a"}</tool_call>',
     ParsedReply("", (call("a"),))),
    ("empty object is no call", H, '<tool_call>{}</tool_call>', None),
    ("arguments not an object", H, '<tool_call>{"name": "a", "arguments": [1]}</tool_call>', None),
    # llama3_json
    ("llama3 call", L, '{"name": "calc", "parameters": {"x": 1}}', ParsedReply("", (call("calc", x=1),))),
    ("llama3 python tag", L, '<|python_tag|>{"name": "calc", "parameters": {}}', ParsedReply("", (call("calc"),))),
    ("llama3 two", L, '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"z": null}}',
     ParsedReply("", (call("a"), call("b", z=None)))),
    ("llama3 text", L, "It is 4.", ParsedReply("It is 4.")),
    ("llama3 json not a call", L, '{"x": 1}', None),
    ("llama3 cut", L, '{"name": "a", "parameters": {"x"', None),
    ("llama3 trailing text", L, '{"name": "a", "parameters": {}} and then', None),
    # mistral
    ("mistral", M, '[TOOL_CALLS][{"name": "a", "arguments": {"b": 1}}, {"name": "c", "arguments": {}}]',
     ParsedReply("", (call("a", b=1), call("c")))),
    ("mistral with text", M, 'Sure. [TOOL_CALLS][{"name": "a", "arguments": {}}]', ParsedReply("Sure.", (call("a"),))),
    ("mistral no call", M, 'Done. [TOOL_CALLS][]', ParsedReply("Done.", empty=True)),
    ("mistral cut", M, '[TOOL_CALLS][{"name": "a", "argum', None),
    ("mistral none", M, "hello", ParsedReply("hello")),
    # pythonic
    ("pythonic", P, '[get_weather(city="Paris"), f(a=1, b=[1, 2])]',
     ParsedReply("", (call("get_weather", city="Paris"), call("f", a=1, b=[1, 2])))),
    ("pythonic no args", P, "[now()]", ParsedReply("", (call("now"),))),
    ("pythonic text", P, "The list is [1, 2]", ParsedReply("The list is [1, 2]")),
    ("pythonic positional", P, "[f(1)]", None),
    ("pythonic not literal", P, "[f(a=os.system)]", None),
    ("pythonic cut", P, "[f(a=1", None),
    ("pythonic method", P, "[a.b(c=1)]", None),
    # none
    ("none", ToolCallFormat.NONE, '<tool_call>{"name": "a"}</tool_call>', None),
]


@pytest.mark.parametrize(("text", "fmt", "expected"), [pytest.param(t, f, e, id=n) for n, f, t, e in CASES])
def test_parse_reply(text: str, fmt: ToolCallFormat, expected: ParsedReply | None) -> None:
    reply = parse_reply(text, fmt)
    assert reply == (expected or ParsedReply(text, malformed=reply.malformed)), "None: the whole text is content"
    assert reply.malformed == (expected is None and fmt is not ToolCallFormat.NONE), "markup that does not parse"


def test_a_call_in_openais_shape() -> None:
    assert call("f", x=1).openai("call_1") == {
        "id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'},
    }


@pytest.mark.parametrize(
    ("template", "fmt"),
    [
        ("{% for m in messages %}[TOOL_CALLS]{% endfor %}", M),
        ("{{ '<tool_call>\\n' }}{{ tool_call | tojson }}", H),
        ("Respond in the format [func_name1(params_name1=params_value1)]", P),
        ("{{ '<|python_tag|>' }}", L),
        ("{{ '<|im_start|>' + message['role'] }}", H),  # ChatML that ignores tools: rein's own form
    ],
)
def test_detect_format(template: str, fmt: ToolCallFormat) -> None:
    assert detect_format(template) is fmt


@given(st.text(max_size=200), st.sampled_from(list(ToolCallFormat)))
def test_any_text_parses_without_raising_and_keeps_text_without_calls(text: str, fmt: ToolCallFormat) -> None:
    reply = parse_reply(text, fmt)
    if not reply.calls:
        assert reply.content == text
    for c in reply.calls:
        assert isinstance(json.loads(c.arguments), dict) and c.name
