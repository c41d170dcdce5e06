"""A chat template that rewrites history: Qwen3's drops earlier turns' thinking once a new user message arrives,
so no later call can continue the segment token-exact. ``keep`` keeps the session one segment (the engine sees
its own ids verbatim, each new message rendered as the template renders it after them); ``follow`` starts a new
segment per turn (``template_mismatch``) whose prompt is the template's rewritten history.

:func:`episode` plays the same 5-turn episode both ways on the Qwen3-style template fixture and counts what the
trainer gets; the numbers are docs/agents.md's ("Templates that rewrite history").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from services.proxy.engine_client import EngineOutput
from services.proxy.generation import ChunkOutcome, Generation
from services.proxy.session_machine import Session
from services.proxy.transcript import RewrittenHistory
from shared.model.hf_chat import HFChatTokenizer
from tests.support.templates import qwen3_style

SYSTEM = {"role": "system", "content": "You are a careful assistant. Think before you answer."}
TURNS = 5


@pytest.fixture(scope="module")
def qwen3(smollm2_dir: Path) -> HFChatTokenizer:
    return qwen3_style(smollm2_dir)


def reply(turn: int) -> str:
    thinking = " ".join(f"Step {k}: the user asked question {turn}, so I weigh option {k} against the others."
                        for k in range(4))
    return f"<think>\n{thinking}\n</think>\n\nThe answer to question {turn} is {turn * 7}."


@dataclass
class Episode:
    session: Session
    trainer_tokens: int
    """Tokens of every sample the trainer gets (one per segment): its forward pass runs over all of them."""
    trained_tokens: int
    """Tokens in the loss: the sampled ones."""
    prompts: list[list[int]]
    """What the engine was given on each call."""


def episode(tok: HFChatTokenizer, rewritten: RewrittenHistory, turns: int = TURNS) -> Episode:
    session = Session("s", "g", tokenizer=tok, tool_calls=tok.tool_call_format, rewritten_history=rewritten)
    end = tok.inner.convert_tokens_to_ids("<|im_end|>")
    messages: list[dict[str, Any]] = [SYSTEM]
    prompts = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Question {turn}: what is {turn} times 7?"})
        plan = session.begin(messages, f"t{turn}")
        prompts.append(list(plan.prompt_ids))
        sampled = [*tok.inner.encode(reply(turn), add_special_tokens=False), end]
        out = EngineOutput(f"r{turn}", sampled, [-0.1] * len(sampled), "v1", ["v1"] * len(sampled), "stop")
        session.chunk(ChunkOutcome(0, plan.context_ids, out), "e")
        session.chunk_sent()
        answer = session.complete(Generation(output_ids=sampled, finish_reason="stop", chunks=[]))
        messages.append({"role": "assistant", "content": answer.content})  # thinking dropped, as clients do
    return Episode(session, sum(len(seg.token_ids) for seg in session.segments),
                   sum(v is not None for seg in session.segments for v in seg.versions), prompts)


def test_keep_is_one_segment_the_engine_seeing_its_own_ids(qwen3: HFChatTokenizer) -> None:
    kept = episode(qwen3, "keep")
    [segment] = kept.session.segments
    assert segment.token_ids == [i for context, sampled in segment.turns for i in (*context, *sampled)]
    for before, after in zip(kept.prompts, kept.prompts[1:], strict=False):
        assert after[:len(before)] == before, "every call extends the last: nothing re-tokenized"
    _, last_sampled = segment.turns[-1]
    last_context, _ = segment.turns[-1]
    assert qwen3._text(last_context) == (f"\n<|im_start|>user\nQuestion {TURNS - 1}: what is {TURNS - 1} times 7?"
                                         "<|im_end|>\n<|im_start|>assistant\n"), "the new message as rendered"
    assert "<think>" in qwen3._text(segment.token_ids[: -len(last_sampled)]), "earlier thinking stays in context"


def test_follow_starts_a_segment_per_turn_on_the_templates_history(qwen3: HFChatTokenizer) -> None:
    followed = episode(qwen3, "follow")
    assert len(followed.session.segments) == TURNS
    last = followed.session.segments[-1]
    assert qwen3._text(last.turns[0][0]).count("<think>") == 0, "earlier thinking dropped, as the template does"


def test_trainer_tokens_per_episode_keep_against_follow(qwen3: HFChatTokenizer) -> None:
    """The measurement behind the default (``keep``): the same sampled tokens are trained either way; ``follow``
    makes the trainer read each turn's history again in a sample of its own (without the earlier thinking,
    which the template dropped), a cost that grows with the square of the turns, where ``keep`` reads every
    token once."""
    ratios = []
    for turns in (TURNS, 2 * TURNS):
        kept, followed = episode(qwen3, "keep", turns), episode(qwen3, "follow", turns)
        assert kept.trained_tokens == followed.trained_tokens
        assert (len(kept.session.segments), len(followed.session.segments)) == (1, turns)
        print(f"\n{turns}-turn episode, trainer tokens: keep {kept.trainer_tokens} (1 sample), "
              f"follow {followed.trainer_tokens} ({turns} samples); trained tokens {kept.trained_tokens} in both")
        ratios.append(followed.trainer_tokens / kept.trainer_tokens)
    assert 1.5 < ratios[0] < ratios[1], "follow costs more, and more so the longer the episode"
