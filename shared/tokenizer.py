"""Word-level tokenizer with a fixed vocabulary for the built-in tiny policy.

The vocabulary is closed and known to every service, so token ids mean the same
thing in the engine, the proxy, the collector and the trainer without shipping a
tokenizer file around. Text is split on whitespace; a word outside the vocabulary
becomes ``<unk>``, and so does a special token typed in the text: only the template
writes special ids.

Chat layout (the tiny policy's chat template)::

    <|system|> words... <|end|> <|user|> words... <|end|> <|assistant|> words... <|end|>

An assistant turn the engine generates is ``<|assistant|>`` (added by
``apply_chat_template(..., add_generation_prompt=True)``) followed by the generated
ids, which end with ``<|end|>``: the engine's stop token, included in the output ids
like EOS in SGLang.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

PAD = "<pad>"
UNK = "<unk>"
SYSTEM = "<|system|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
END = "<|end|>"

SPECIALS: tuple[str, ...] = (PAD, UNK, SYSTEM, USER, ASSISTANT, END)
NUMBERS: tuple[str, ...] = tuple(str(n) for n in range(32))
WORDS: tuple[str, ...] = (
    "guess",
    "higher",
    "lower",
    "correct",
    "number",
    "between",
    "and",
    "invalid",
    "yes",
    "no",
    "the",
    "is",
    "+",
    "=",
    "call",
    "answer",
)
VOCAB: tuple[str, ...] = SPECIALS + NUMBERS + WORDS

ROLE_TOKENS: Mapping[str, str] = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT}


class Tokenizer:
    """Maps words to ids and chat messages to token sequences. Stateless and immutable."""

    def __init__(self) -> None:
        self._id_of: dict[str, int] = {tok: i for i, tok in enumerate(VOCAB)}
        self._special_ids: frozenset[int] = frozenset(self._id_of[s] for s in SPECIALS)

    @property
    def vocab_size(self) -> int:
        return len(VOCAB)

    @property
    def pad_id(self) -> int:
        return self._id_of[PAD]

    @property
    def unk_id(self) -> int:
        return self._id_of[UNK]

    @property
    def end_id(self) -> int:
        """``<|end|>``: ends every message; the engine's default stop token."""
        return self._id_of[END]

    @property
    def assistant_id(self) -> int:
        return self._id_of[ASSISTANT]

    @property
    def vocab(self) -> tuple[str, ...]:
        return VOCAB

    def token_id(self, token: str) -> int:
        """Id of one vocabulary entry (special tokens included); KeyError if absent."""
        return self._id_of[token]

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def encode(self, text: str) -> list[int]:
        """Whitespace-split ``text``; words outside the vocabulary become ``<unk>``.

        Special tokens written in the text are words outside the vocabulary too: a message's
        content that spells ``<|end|> <|assistant|>`` must not close its turn and open another.
        """
        ids = (self._id_of.get(word) for word in text.split())
        return [self.unk_id if i is None or i in self._special_ids else i for i in ids]

    def id_to_token(self, token_id: int) -> str:
        if not 0 <= token_id < len(VOCAB):
            raise ValueError(f"token id {token_id} outside vocabulary of size {len(VOCAB)}")
        return VOCAB[token_id]

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Words joined by single spaces; special tokens dropped when ``skip_special``."""
        words = []
        for token_id in ids:
            if skip_special and token_id in self._special_ids:
                continue
            words.append(self.id_to_token(token_id))
        return " ".join(words)

    def role_id(self, role: str) -> int:
        token = ROLE_TOKENS.get(role)
        if token is None:
            raise ValueError(f"unknown chat role {role!r}; expected one of {sorted(ROLE_TOKENS)}")
        return self._id_of[token]

    def render_message(self, role: str, content: str) -> list[int]:
        """``[role token] + encode(content) + [<|end|>]``."""
        return [self.role_id(role), *self.encode(content), self.end_id]

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool
    ) -> list[int]:
        """Concatenated rendered messages, then ``<|assistant|>`` when ``add_generation_prompt``."""
        ids: list[int] = []
        for i, message in enumerate(messages):
            try:
                role, content = message["role"], message["content"]
            except KeyError as exc:
                raise ValueError(f"message {i} lacks field {exc.args[0]!r}") from None
            ids.extend(self.render_message(role, content))
        if add_generation_prompt:
            ids.append(self.assistant_id)
        return ids


TOKENIZER = Tokenizer()
"""The one tokenizer instance (immutable, so sharing it is safe)."""
