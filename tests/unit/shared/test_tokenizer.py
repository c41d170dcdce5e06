"""The fixed-vocabulary tokenizer and chat template."""

from __future__ import annotations

import pytest

from shared.tokenizer import ASSISTANT, END, SPECIALS, TOKENIZER, VOCAB, Tokenizer


def test_vocabulary_layout() -> None:
    assert VOCAB[0] == "<pad>"
    assert TOKENIZER.pad_id == 0
    assert VOCAB[: len(SPECIALS)] == ("<pad>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
    assert [TOKENIZER.token_id(str(n)) for n in range(32)] == list(range(6, 38))
    assert TOKENIZER.vocab_size == len(VOCAB) == len(set(VOCAB)) == 54
    assert VOCAB[TOKENIZER.end_id] == END
    assert VOCAB[TOKENIZER.assistant_id] == ASSISTANT


def test_encode_decode_round_trip() -> None:
    text = "guess the number between 0 and 31"
    ids = TOKENIZER.encode(text)
    assert len(ids) == 7
    assert TOKENIZER.decode(ids) == text


def test_unknown_words_and_whitespace() -> None:
    ids = TOKENIZER.encode("  hello \n 7\tworld  ")
    assert ids == [TOKENIZER.unk_id, TOKENIZER.token_id("7"), TOKENIZER.unk_id]
    assert TOKENIZER.decode(ids) == "7"
    assert TOKENIZER.decode(ids, skip_special=False) == "<unk> 7 <unk>"
    assert TOKENIZER.encode("") == []


def test_special_tokens_in_text_are_unknown_words() -> None:
    """Text is text: a marker typed in it is a word outside the vocabulary, not the marker's id."""
    unk = TOKENIZER.unk_id
    assert TOKENIZER.encode("guess <|end|> <|assistant|> <pad>") == [TOKENIZER.token_id("guess"), unk, unk, unk]
    assert TOKENIZER.render_message("user", "<|end|>") == [TOKENIZER.token_id("<|user|>"), unk, TOKENIZER.end_id]


def test_render_message_and_template() -> None:
    user = TOKENIZER.render_message("user", "guess")
    assert user == [TOKENIZER.token_id("<|user|>"), TOKENIZER.token_id("guess"), TOKENIZER.end_id]
    msgs = [{"role": "system", "content": "the number"}, {"role": "user", "content": "guess"}]
    ids = TOKENIZER.apply_chat_template(msgs, add_generation_prompt=True)
    assert ids == TOKENIZER.render_message("system", "the number") + user + [TOKENIZER.assistant_id]
    assert TOKENIZER.apply_chat_template(msgs, add_generation_prompt=False) == ids[:-1]
    rendered = "<|system|> the number <|end|> <|user|> guess <|end|> <|assistant|>"
    assert TOKENIZER.decode(ids, skip_special=False) == rendered


def test_unknown_role_is_named() -> None:
    with pytest.raises(ValueError, match="'tool'"):
        TOKENIZER.render_message("tool", "hi")
    with pytest.raises(ValueError, match="content"):
        TOKENIZER.apply_chat_template([{"role": "user"}], add_generation_prompt=True)


def test_decode_rejects_out_of_range() -> None:
    with pytest.raises(ValueError, match="outside vocabulary"):
        TOKENIZER.decode([TOKENIZER.vocab_size])


def test_instances_agree() -> None:
    assert Tokenizer().encode("yes no 3") == TOKENIZER.encode("yes no 3")
