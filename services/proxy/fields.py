"""Every field of a wire's request body is honoured, accepted as harmless, or refused by name.

An agent that sends a field the proxy silently drops trains on something else than it asked for (a
``seed``, a reasoning effort, a structured output). So each wire's request model declares the fields it
honours (and refuses their values it cannot serve), names those it accepts and ignores because they change
nothing that is sampled or answered (:data:`OPENAI_HARMLESS`, :data:`ANTHROPIC_HARMLESS`), and refuses
every other field with 400 ``unsupported_parameter`` naming it: a field it knows and cannot honour (with
the reason), or one it does not know at all (a vendor extension, a field newer than this list).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

OPENAI_HARMLESS = frozenset({
    "store", "metadata", "user", "service_tier", "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention",
    "safety_identifier", "prediction", "include", "stream_options",
})
"""Fields of OpenAI's chat-completions and Responses bodies accepted and ignored: storage (nothing is stored;
``previous_response_id`` is refused), metadata, billing tier, caching keys, abuse tracking, a predicted output
(it only speeds generation up), which extra fields a Responses answer includes, and ``stream_options``
(``include_usage`` is honoured on chat: a usage chunk before ``[DONE]``)."""

ANTHROPIC_HARMLESS = frozenset({
    "metadata", "service_tier", "cache_control", "inference_geo", "user_profile_id", "workspace_id",
})
"""Fields of Anthropic's Messages body accepted and ignored: metadata (``user_id``), billing tier, prompt
caching, where the request is served, the account it is for."""

WHY_UNKNOWN = "not a field this proxy knows: refused rather than ignored (docs/agents.md, 'Request fields')"


def refused_fields(extra: Mapping[str, Any] | None, harmless: frozenset[str],
                   refused: Mapping[str, str]) -> dict[str, str]:
    """Each field of ``extra`` (what the request model did not declare) that is neither harmless nor None,
    with why it is refused: ``refused[name]`` when the wire knows it, else :data:`WHY_UNKNOWN`."""
    return {name: refused.get(name, WHY_UNKNOWN) for name, value in (extra or {}).items()
            if name not in harmless and value is not None}
