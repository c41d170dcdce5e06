"""The proxy's session store: TITO appends, new segments, lifecycle errors."""

from __future__ import annotations

import pytest

from services.proxy.sessions import Session, SessionStore
from shared.errors import BadRequest, SessionBusy, SessionFinalized, SessionNotFound
from shared.model.tiny_chat import TinyChatTokenizer
from shared.tokenizer import TOKENIZER as TOK

CHAT = TinyChatTokenizer(TOK)

SYSTEM = ("system", "guess the number")
USER1 = ("user", "guess")
USER2 = ("user", "higher")


def run_turn(session: Session, messages: list[tuple[str, str]], output: list[int], version: str = "v1") -> list[int]:
    """Plan a call, record one chunk with ``output``, complete it; returns the chunk's context ids."""
    plan = session.plan(dicts(messages), CHAT)
    session.record_chunk(plan, plan.context_ids, output, [version] * len(output))
    return list(plan.context_ids)


def dicts(messages: list[tuple[str, str]]) -> list[dict[str, str]]:
    return [{"role": role, "content": content} for role, content in messages]


def test_first_call_renders_full_template() -> None:
    session = Session("s", "g")
    plan = session.plan(dicts([SYSTEM, USER1]), CHAT)
    expected = TOK.apply_chat_template([{"role": r, "content": c} for r, c in (SYSTEM, USER1)], True)
    assert plan.new_segment and plan.segment_index == 0
    assert list(plan.context_ids) == expected == list(plan.prompt_ids)


def test_extension_appends_only_new_messages_and_header() -> None:
    session = Session("s", "g")
    out = [TOK.token_id("5"), TOK.end_id]
    first_ctx = run_turn(session, [SYSTEM, USER1], out)
    assistant = ("assistant", TOK.decode(out))
    plan = session.plan(dicts([SYSTEM, USER1, assistant, USER2]), CHAT)
    assert not plan.new_segment and plan.segment_index == 0
    assert list(plan.context_ids) == [*TOK.render_message(*USER2), TOK.assistant_id]
    assert list(plan.prompt_ids) == [*first_ctx, *out, *plan.context_ids]


def test_engine_tokens_are_kept_not_retokenised() -> None:
    """The segment holds the engine's ids even when decoding drops some (special tokens)."""
    session = Session("s", "g")
    out = [TOK.token_id("5"), TOK.pad_id, TOK.end_id]  # <pad> vanishes from the text
    first_ctx = run_turn(session, [USER1], out)
    plan = session.plan(dicts([USER1, ("assistant", "5"), USER2]), CHAT)
    assert not plan.new_segment
    assert list(plan.prompt_ids[: len(first_ctx) + len(out)]) == [*first_ctx, *out]


def test_output_cut_by_length_gets_end_token_in_next_context() -> None:
    session = Session("s", "g")
    out = [TOK.token_id("5"), TOK.token_id("6")]  # no <|end|>: budget ran out
    run_turn(session, [USER1], out)
    plan = session.plan(dicts([USER1, ("assistant", "5 6"), USER2]), CHAT)
    assert list(plan.context_ids) == [TOK.end_id, *TOK.render_message(*USER2), TOK.assistant_id]


def test_rewritten_history_starts_new_segment() -> None:
    session = Session("s", "g")
    run_turn(session, [SYSTEM, USER1], [TOK.token_id("5"), TOK.end_id])
    plan = session.plan(dicts([SYSTEM, ("user", "lower")]), CHAT)
    assert plan.new_segment and plan.segment_index == 1
    assert list(plan.context_ids) == TOK.apply_chat_template(
        [{"role": "system", "content": SYSTEM[1]}, {"role": "user", "content": "lower"}], True
    )


def test_assistant_message_must_match_what_was_returned() -> None:
    session = Session("s", "g")
    run_turn(session, [USER1], [TOK.token_id("5"), TOK.end_id])
    plan = session.plan(dicts([USER1, ("assistant", "7"), USER2]), CHAT)
    assert plan.new_segment


def test_new_segment_opens_only_with_first_chunk() -> None:
    session = Session("s", "g")
    run_turn(session, [USER1], [TOK.end_id])
    plan = session.plan(dicts([USER2]), CHAT)
    assert plan.new_segment and len(session.segments) == 1  # planning changes nothing
    seq = session.record_chunk(plan, plan.context_ids, [TOK.end_id], ["v2"])
    assert seq == 1 and len(session.segments) == 2 and session.num_chunks == 2


def test_continuation_chunks_and_versions() -> None:
    session = Session("s", "g")
    plan = session.plan(dicts([USER1]), CHAT)
    session.record_chunk(plan, plan.context_ids, [10, 11], ["v1", "v1"])
    session.record_chunk(plan, (), [12, 13, TOK.end_id], ["v1", "v2", "v2"])  # the engine swapped mid-request
    seg = session.segments[0]
    assert seg.token_ids == [*plan.context_ids, 10, 11, 12, 13, TOK.end_id]
    assert seg.versions == [None] * len(plan.context_ids) + ["v1", "v1", "v1", "v2", "v2"]
    assert session.versions() == ["v1", "v2"]
    with pytest.raises(ValueError, match="1 versions for 2 output tokens"):
        session.record_chunk(plan, (), [14, 15], ["v2"])


def test_unknown_versions_are_not_recorded_as_real() -> None:
    session = Session("s", "g")
    plan = session.plan(dicts([USER1]), CHAT)
    session.record_chunk(plan, plan.context_ids, [10], [None])  # labels arrive normalised: None is "not real"
    session.record_chunk(plan, (), [11], [None])
    assert session.versions() == []


def test_closed_segment_is_never_extended() -> None:
    session = Session("s", "g")
    out = [TOK.token_id("5"), TOK.end_id]
    run_turn(session, [USER1], out)
    plan = session.plan(dicts([USER1, ("assistant", "5"), USER2]), CHAT)
    session.record_chunk(plan, plan.context_ids, [10], ["v1"])
    session.close_segment(plan)
    again = session.plan(dicts([USER1, ("assistant", "5"), USER2]), CHAT)
    assert again.new_segment and again.segment_index == 1


def test_unknown_role_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="tool"):
        Session("s", "g").plan(dicts([("tool", "x")]), CHAT)


def test_store_lifecycle() -> None:
    store = SessionStore(finalized_memory=2)
    session = store.acquire("a", "g")
    with pytest.raises(SessionBusy):
        store.acquire("a", "g")
    store.release(session)
    with pytest.raises(BadRequest):
        store.acquire("a", "other-group")
    assert store.get("a") is session
    with pytest.raises(SessionNotFound):
        store.get("missing")
    store.finalize(session, "finished")
    with pytest.raises(SessionFinalized) as info:
        store.acquire("a", "g")
    assert info.value.detail()["outcome"] == "finished"
    with pytest.raises(SessionFinalized):
        store.get("a")
    for name in ("b", "c"):
        store.finalize(store.acquire(name, "g"), "finished")
    assert store.outcome("a") is None  # bounded memory: the oldest id is forgotten
    assert len(store) == 0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_idle_counts_from_the_last_call_start_or_end_and_skips_busy_sessions() -> None:
    clock = FakeClock()
    store = SessionStore(clock=clock)
    a = store.acquire("a", "g")  # a call starts at 1000 and is still running
    b = store.acquire("b", "g")
    store.release(b)  # b's call ended at 1000
    clock.now = 1005.0
    c = store.acquire("c", "g")
    store.release(c)  # c's call ended at 1005
    clock.now = 1009.9
    assert store.idle(10.0) == []
    clock.now = 1010.0
    assert store.idle(10.0) == [b]  # a is busy however long its call takes
    clock.now = 1100.0
    assert store.idle(10.0) == [b, c]  # oldest first
    store.release(a)
    assert store.idle(10.0) == [b, c]
    clock.now = 1110.0
    assert store.idle(10.0) == [b, c, a]
    store.finalize(b, "rejected (session_idle)")
    assert store.idle(10.0) == [c, a]


def test_a_new_call_resets_the_idle_time() -> None:
    clock = FakeClock()
    store = SessionStore(clock=clock)
    store.release(store.acquire("a", "g"))
    clock.now = 1009.0
    store.release(store.acquire("a", "g"))
    clock.now = 1015.0
    assert store.idle(10.0) == []
    clock.now = 1019.0
    assert [s.session_id for s in store.idle(10.0)] == ["a"]
