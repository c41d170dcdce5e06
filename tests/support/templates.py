"""Chat-template fixtures written here, on SmolLM2's tokenizer (offline): the conventions of model families
whose own tokenizers are not installed, built the way ``tests/unit/model/test_added_tokens.py`` builds its
Qwen-style one.

- :data:`QWEN3_TEMPLATE`: a Qwen3-style template. Tools in the system message, calls as
  ``<tool_call>\\n{json}\\n</tool_call>``, results inside ``<tool_response>`` in a user turn, and a reasoning
  model's history rule: an assistant's thinking (``reasoning_content``, or the content's ``<think>…</think>``)
  is rendered only for the turns after the last user message; earlier turns lose it. So the template
  rewrites history whenever a new user message arrives.

:data:`QWEN_SYSTEM_AND_USER` and :data:`QWEN_CALLS_AND_RESULTS` are the parts every Qwen-style template here
shares (the system and user turns; an assistant's calls, the tool turn, the generation prompt), so a template
spells out only its own convention; :func:`with_template` builds a tokenizer from markers and a template.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from shared.model.hf_chat import HFChatTokenizer

QWEN_ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
"""Added to the tokenizer as tokens that are not *special*, as Qwen-family tokenizers add them."""

QWEN_SYSTEM_AND_USER = """{% elif messages[0].role == 'system' -%}
<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif -%}
{%- for message in messages -%}
{%- if message.role == 'user' -%}
<|im_start|>user
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' -%}
"""
"""The middle of a Qwen-style template, after its ``{%- if tools -%}`` system message (which lists the tools
its own way): a system message without tools, the loop over messages, a user turn, and the line that opens an
assistant's turn (its rendering is the template's own)."""

QWEN_CALLS_AND_RESULTS = """{% endif %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' -%}
<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}
"""
"""The end of a Qwen-style template, after the line that opens an assistant's calls
(``{%- for call in message.tool_calls or [] %}{% if … or not loop.first %}``, closed by its first
``{% endif %}``): each call as ``<tool_call>\\n{json}\\n</tool_call>``, a tool's result inside
``<tool_response>`` in a user turn, and the generation prompt."""

QWEN3_TEMPLATE = """
{%- set ns = namespace(last_query=-1) -%}
{%- for message in messages -%}
{%- if message.role == 'user' %}{% set ns.last_query = loop.index0 %}{% endif -%}
{%- endfor -%}
{%- if tools -%}
<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}Tools you may call:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools><|im_end|>
""" + QWEN_SYSTEM_AND_USER + """{%- set content = message.content or '' -%}
{%- set reasoning = '' -%}
{%- if message.reasoning_content is string -%}
{%- set reasoning = message.reasoning_content -%}
{%- elif '</think>' in content -%}
{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}
{%- set content = content.split('</think>')[-1] -%}
{%- endif -%}
<|im_start|>assistant
{% if loop.index0 > ns.last_query and reasoning -%}
<think>
{{ reasoning.strip('\\n') }}
</think>

{% endif -%}
{{ content.lstrip('\\n') }}
{%- for call in message.tool_calls or [] %}{% if content.strip() or not loop.first %}
""" + QWEN_CALLS_AND_RESULTS


def with_template(smollm2_dir: Path, added: list[str], template: str) -> HFChatTokenizer:
    """SmolLM2's tokenizer with ``added`` as tokens that are not special and ``template`` as its chat template."""
    inner = AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    assert inner.add_tokens(added, special_tokens=False) == len(added)
    inner.chat_template = template
    return HFChatTokenizer(inner)


def qwen3_style(smollm2_dir: Path) -> HFChatTokenizer:
    """SmolLM2's tokenizer with Qwen's added tokens and :data:`QWEN3_TEMPLATE`."""
    return with_template(smollm2_dir, QWEN_ADDED, QWEN3_TEMPLATE)
