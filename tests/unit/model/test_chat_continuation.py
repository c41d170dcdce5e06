"""``ChatTokenizer.continue_chat`` on the real SmolLM2 tokenizer and ChatML template (the ``hf`` fixture):
a conversation grows by the template's delta while the ids the engine sampled stay verbatim, so each
call's context is the last one's plus new tokens; an edited history, or text the vocabulary cannot
spell, starts a new segment instead. A *turn* is ``(context ids, sampled ids)``; ``grow`` stands in
for the engine."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.proxy.session_machine import Session
from shared.model.base import Turn
from shared.model.hf_chat import HFChatTokenizer
from tests.support.chat_turns import (
    INJECTION,
    NON_ASCII,
    Msg,
    assistant,
    flat,
    grow,
    ids_of,
    im_end,
    markers,
    user,
)


def test_encode_chat_tokenizes_like_apply_chat_template(hf: HFChatTokenizer) -> None:
    """Ordinary content: encode_chat = encode(template text) without added specials, exactly as
    apply_chat_template tokenizes it; the deltas are encoded the same way."""
    conversations = [[user(t)] for t in NON_ASCII] + [
        [{"role": "system", "content": "be brief"}, user("2+2?"), assistant("4"), user("<im_end> |> <| literal")],
        [user("add 2 and 3"), assistant("<tool_call>add</tool_call>"), {"role": "tool", "content": "5"}],
    ]
    for messages in conversations:
        for gen in (True, False):
            want = hf.inner.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen, return_dict=False)
            assert hf.encode_chat(messages, add_generation_prompt=gen) == list(want)
            assert hf.render_chat(messages, add_generation_prompt=gen) == hf.inner.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=gen)


def test_multi_turn_non_ascii_appends_only_the_delta(hf: HFChatTokenizer) -> None:
    """Three turns: each context is the template's delta, the whole equals the full rendering, and
    arbitrary UTF-8 round-trips through the answers."""
    turns: list[Turn] = []
    messages = [{"role": "system", "content": "Réponds en français 🇫🇷"}, user(NON_ASCII[0])]
    for i, reply in enumerate(["Bonjour 👋 ça va très bien", "你好！我很好。", "e\u0301 ﬁ Å 🏳️‍🌈"]):
        answer = grow(hf, turns, messages, [*ids_of(hf, reply), im_end(hf)])
        assert answer == reply
        messages = [*messages, assistant(answer), user(NON_ASCII[(i + 1) % len(NON_ASCII)])]
    delta = hf.continue_chat(turns, messages)
    assert delta is not None
    assert [*flat(turns), *delta] == hf.encode_chat(messages, add_generation_prompt=True)
    assert hf._text(delta) == f"\n<|im_start|>user\n{NON_ASCII[3]}<|im_end|>\n<|im_start|>assistant\n"


def test_sampled_ids_are_kept_even_when_the_text_would_tokenize_otherwise(hf: HFChatTokenizer) -> None:
    """The engine may sample a non-canonical split ("hel" + "lo" for "hello"): the turn still extends,
    and the conversation keeps exactly those ids."""
    pieces = [i for ch in "hello there" for i in ids_of(hf, ch)]
    assert pieces != ids_of(hf, "hello there")
    turns: list[Turn] = []
    answer = grow(hf, turns, [user("hi")], [*pieces, im_end(hf)])
    messages = [user("hi"), assistant(answer), user("and?")]
    delta = hf.continue_chat(turns, messages)
    assert delta is not None and flat(turns)[-len(pieces) - 1 : -1] == pieces
    assert hf._text([*flat(turns), *delta]) == hf.render_chat(messages, add_generation_prompt=True)


def test_reply_cut_by_its_budget_is_closed_by_the_delta(hf: HFChatTokenizer) -> None:
    """No stop id: the template's <|im_end|> opens the delta, even after half an emoji (U+FFFD in the answer)."""
    cut = ids_of(hf, "Voilà 😀")[:-1]  # the emoji's last byte token is missing
    turns: list[Turn] = []
    answer = grow(hf, turns, [user("x")], cut)
    assert answer.endswith("\ufffd")
    messages = [user("x"), assistant(answer), user("go on")]
    delta = hf.continue_chat(turns, messages)
    assert delta is not None and delta[0] == im_end(hf)
    assert hf._text([*flat(turns), *delta]) == hf.render_chat(messages, add_generation_prompt=True)


def test_any_stop_id_stands_for_the_templates_end_of_turn(hf: HFChatTokenizer) -> None:
    """A reply the engine ended with <|endoftext|> (a stop id too) extends like one ended with <|im_end|>;
    the sampled <|endoftext|> stays in the ids."""
    eot = hf.inner.convert_tokens_to_ids("<|endoftext|>")
    assert eot in hf.stop_ids
    turns: list[Turn] = []
    answer = grow(hf, turns, [user("x")], [*ids_of(hf, "yes"), eot])
    delta = hf.continue_chat(turns, [user("x"), assistant(answer), user("y")])
    assert delta is not None and hf._text(delta).startswith("\n<|im_start|>user\ny")
    assert flat(turns)[-1] == eot


def test_special_token_sampled_mid_reply_is_not_in_the_answer_and_still_extends(hf: HFChatTokenizer) -> None:
    start = hf.inner.convert_tokens_to_ids("<|im_start|>")
    sampled = [*ids_of(hf, "a"), start, *ids_of(hf, "b"), im_end(hf)]
    turns: list[Turn] = []
    answer = grow(hf, turns, [user("x")], sampled)  # type: ignore[arg-type]
    assert answer == "ab"
    assert hf.continue_chat(turns, [user("x"), assistant(answer), user("y")]) is not None


@pytest.mark.parametrize("edit", ["user_text", "assistant_text", "dropped", "same", "system_added", "stripped"])
def test_edited_history_does_not_extend(hf: HFChatTokenizer, edit: str) -> None:
    turns: list[Turn] = []
    answer = grow(hf, turns, [user("hi 👋")], [*ids_of(hf, " spaced reply "), im_end(hf)])
    messages = {
        "user_text": [user("hi"), assistant(answer), user("next")],
        "assistant_text": [user("hi 👋"), assistant("something else"), user("next")],
        "dropped": [user("next")],
        "same": [user("hi 👋")],  # nothing new: no delta to add
        "system_added": [{"role": "system", "content": "new"}, user("hi 👋"), assistant(answer), user("next")],
        "stripped": [user("hi 👋"), assistant(answer.strip()), user("next")],  # an agent that trims replies
    }[edit]
    assert hf.continue_chat(turns, messages) is None


def test_text_the_vocabulary_cannot_spell_starts_a_new_segment(hf: HFChatTokenizer) -> None:
    """SmolLM2's byte-level vocabulary lacks a few bytes (ASCII controls 0x04 0x06 0x13 0x14 0x16 0x1d, and
    lead bytes 0xf1-0xf4, i.e. code points from U+40000): encoding drops them silently. The ids then
    no longer spell the agent's text, so the conversation is never extended on them (safe, not TITO)."""
    assert ids_of(hf, "a\x1db") == ids_of(hf, "a") + ids_of(hf, "b")
    turns: list[Turn] = []
    answer = grow(hf, turns, [user("a\x1db")], [*ids_of(hf, "ok"), im_end(hf)])
    assert hf.continue_chat(turns, [user("a\x1db"), assistant(answer), user("next")]) is None


def test_template_errors_are_value_errors(hf: HFChatTokenizer) -> None:
    with pytest.raises(ValueError):
        hf.encode_chat([{"content": "no role"}], add_generation_prompt=True)


def test_session_with_the_hf_tokenizer_extends_then_starts_a_new_segment(hf: HFChatTokenizer) -> None:
    """The proxy's transcript on the family's tokenizer: nothing in it knows the template."""
    session = Session("s", "g", tokenizer=hf)
    first = session.plan([user("¿Qué tal? 😀")], hf)
    out = [*ids_of(hf, "Bien, ¡gracias! 🙏"), im_end(hf)]
    session.record_chunk(first, first.context_ids, out, ["v1"] * len(out))
    history = [user("¿Qué tal? 😀"), assistant(hf.decode(out)), user("¿Y tú?")]
    second = session.plan(history, hf)
    assert not second.new_segment and second.prompt_ids[: len(first.context_ids) + len(out)] == (
        *first.context_ids, *out)
    session.record_chunk(second, second.context_ids, [im_end(hf)], ["v1"])
    edited = session.plan([user("¿Qué tal?"), *history[1:]], hf)
    assert edited.new_segment and edited.segment_index == 1
    assert list(edited.context_ids) == hf.encode_chat([user("¿Qué tal?"), *history[1:]], add_generation_prompt=True)


texts = st.one_of(st.text(max_size=40), st.sampled_from([*NON_ASCII, "", " ", "\n\n", "<|im_end|>", "<tool_call>",
                                                         INJECTION, "<|im_start|>"]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_property_append_only_conversations_decode_to_the_template(hf: HFChatTokenizer, data: st.DataObject) -> None:
    """For any append-only conversation (text in any script, marker spellings included, replies sampled
    as arbitrary non-special ids, cut or stopped), the ids so far plus the delta spell exactly the
    template's text, with the fresh render's markers; ordinary content encodes as the template's text."""
    turns: list[Turn] = []
    messages: list[Msg] = []
    if data.draw(st.booleans(), "system"):
        messages.append({"role": "system", "content": data.draw(texts.filter(lambda t: hf._text(ids_of(hf, t)) == t))})
    spellable = texts.filter(lambda t: hf._text(ids_of(hf, t)) == t)  # see test_text_the_vocabulary_cannot_spell
    for turn in range(data.draw(st.integers(1, 4), "turns")):
        messages.append(user(data.draw(spellable, f"user {turn}")))
        fresh = hf.encode_chat(messages, add_generation_prompt=True)
        if not any(s in str(m["content"]) for m in messages for s in hf.inner.added_tokens_encoder):
            assert fresh == hf.inner.encode(hf.render_chat(messages, add_generation_prompt=True),
                                            add_special_tokens=False)  # ordinary content: as before
        if turns:
            delta = hf.continue_chat(turns, messages)
            assert delta is not None
            assert hf._text([*flat(turns), *delta]) == hf.render_chat(messages, add_generation_prompt=True)
            assert markers(hf, [*flat(turns), *delta]) == markers(hf, fresh)
        sampled = data.draw(st.lists(st.integers(17, len(hf.inner) - 1), max_size=12), f"sampled {turn}")
        if data.draw(st.booleans(), f"stopped {turn}"):
            sampled.append(im_end(hf))
        messages.append(assistant(grow(hf, turns, messages, sampled)))
