"""A Hugging Face tokenizer and its chat template as rein's :class:`~shared.model.base.ChatTokenizer`.

Apart from :mod:`shared.model.hf` (the family: weights and checkpoint directories) because rendering
a chat is its own concern: the template's text and ids, added tokens kept out of content, and a
segment continued from the ids that were sampled.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Container, Mapping, Sequence
from typing import Any

from jinja2 import TemplateError
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerBase

from shared.model.base import ModelError, Turn, UnrenderableMessages
from shared.model.chat import Messages, Tools
from shared.model.literals import PRIVATE_USE, Literals, Spellings, strings_in
from shared.model.plain_messages import text_of, tool_call_text, with_parsed_arguments, with_tools_prompt
from shared.model.reasoning import Reasoning, detect_reasoning
from shared.model.tool_calls import ToolCallFormat, call_opener, detect_format

END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>")
"""Special tokens that end a turn in common chat templates; those a tokenizer has become stop ids."""


class HFChatTokenizer:
    """A Hugging Face tokenizer and its chat template behind the :class:`ChatTokenizer` protocol.

    Templates that know nothing of tools (SmolLM2's ChatML) would drop the request's ``tools`` and an
    assistant's ``tool_calls``; for those, the tools open the system message in SmolLM2's trained
    form (:data:`~shared.model.plain_messages.TOOLS_PROMPT`), and each call is folded into the content as a
    ``<tool_call>{json}</tool_call>`` line (the Hermes/Qwen convention), so the model sees both.

    Only the template writes the tokenizer's added tokens, special or not: one spelled in a request's strings
    (content, a tool's result, tool-call arguments) is encoded as text, so it cannot close a turn and forge
    another, close a tool result or forge a call (Qwen-family tokenizers add ``<tool_call>``,
    ``</tool_response>`` and ``<think>`` as tokens that are not *special*).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, extra_eos: Sequence[int] = ()) -> None:
        self.inner = tokenizer
        template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
        self._template = template
        self.template_knows_tools = "tool_calls" in template
        self._tool_call_format = detect_format(template)
        self._reasoning = detect_reasoning(template)
        self._template_reads_reasoning = "reasoning_content" in template
        added = tokenizer.added_tokens_decoder
        self._spellings = {i: t.content for i, t in added.items()}
        """Added ids and their spellings: what the tokenizer parses as one token wherever it reads it."""
        self._markers = {text: i for i, text in self._spellings.items()}
        self._special = Spellings(list(self._markers))
        self._kept = frozenset(i for i, t in added.items() if not t.special)
        """Added ids that are not special: :meth:`decode` keeps them, so an answer the agent got spells them."""
        self._as_text = _without_added(tokenizer, self._kept) if self._kept else None
        """The tokenizer without the non-special added tokens, reading special ones as text: content's ids."""
        stops = {i for i in extra_eos if isinstance(i, int)}
        eos = tokenizer.eos_token_id
        if isinstance(eos, int):
            stops.add(eos)
        special = set(tokenizer.all_special_tokens) | set(tokenizer.get_added_vocab())
        for token in END_OF_TURN:
            if token in special:
                found = tokenizer.convert_tokens_to_ids(token)
                if isinstance(found, int):
                    stops.add(found)
        if not stops:
            raise ModelError(f"tokenizer {tokenizer.name_or_path!r} has no EOS or end-of-turn token")
        self._stop_ids = frozenset(stops)
        texts = {self._text([i]) for i in stops}
        self._stop_texts = tuple(sorted((t for t in texts if t), key=len, reverse=True))
        """Spellings of the stop tokens, longest first: what a final stop id may stand for in the template."""
        pad = tokenizer.pad_token_id
        self._pad_id = pad if isinstance(pad, int) else eos if isinstance(eos, int) else min(stops)

    @property
    def vocab_size(self) -> int:
        return len(self.inner)

    @property
    def pad_id(self) -> int:
        return self._pad_id

    @property
    def stop_ids(self) -> frozenset[int]:
        return self._stop_ids

    @property
    def tool_call_format(self) -> ToolCallFormat:
        return self._tool_call_format

    @property
    def reasoning(self) -> Reasoning | None:
        return self._reasoning

    def _plain(self, messages: Messages) -> list[dict[str, Any]]:
        out = []
        for i, message in enumerate(messages):
            if "role" not in message:
                raise UnrenderableMessages(f"message {i} lacks field 'role'", f"messages.{i}.role")
            plain: dict[str, Any] = dict(message)
            plain["content"] = text_of(message.get("content"))
            if plain.get("role") == "assistant" and self._reasoning is not None and self._template_reads_reasoning:
                self._split_reasoning(plain)
            calls = message.get("tool_calls")
            if calls and not self.template_knows_tools:
                texts = [tool_call_text(c) for c in calls if isinstance(c, Mapping)]
                plain["content"] = "\n".join([plain["content"], *texts] if plain["content"] else texts)
                del plain["tool_calls"]
            elif calls:  # OpenAI sends arguments as a JSON string; templates expect the object
                plain["tool_calls"] = [with_parsed_arguments(c) for c in calls if isinstance(c, Mapping)]
            out.append(plain)
        return out

    def _split_reasoning(self, plain: dict[str, Any]) -> None:
        """An assistant's thinking as the template's ``reasoning_content`` (given, or split off the content's
        ``<think>…</think>``): a template like Qwen3's splits the content itself, but the content's markers
        are hidden from it (:mod:`shared.model.literals`), so the split is made here, where it still sees them."""
        assert self._reasoning is not None
        if plain.get("reasoning_content") is None:
            thinking, answer = self._reasoning.split(plain["content"])
            if thinking is not None and self._reasoning.end in plain["content"]:
                plain["reasoning_content"], plain["content"] = thinking, answer
        elif not isinstance(plain["reasoning_content"], str):
            plain["reasoning_content"] = text_of(plain["reasoning_content"])

    def render_chat(self, messages: Messages, *, add_generation_prompt: bool, tools: Tools = None) -> str:
        """The chat template's text for ``messages`` (:class:`UnrenderableMessages` when the template refuses them)."""
        plain = self._plain(messages)
        literals = self._literals(plain, tools)
        return literals.reveal(self._render(plain, tools, literals, add_generation_prompt=add_generation_prompt))

    def encode_chat(self, messages: Messages, *, add_generation_prompt: bool, tools: Tools = None) -> list[int]:
        """The template's text, tokenized the way ``apply_chat_template(tokenize=True)`` does (no added
        BOS/EOS, the template's special tokens parsed as specials), except that a special token spelled
        in the messages' or tools' strings is text (see :mod:`shared.model.literals`). :meth:`continue_chat`
        encodes its deltas the same way, so both paths give the same ids for the same span."""
        plain = self._plain(messages)
        literals = self._literals(plain, tools)
        return self._encode_marked(self._render(plain, tools, literals, add_generation_prompt=add_generation_prompt),
                                   literals)

    def append_chat(
        self, turns: Sequence[Turn], messages: Messages, new_from: int, *, tools: Tools = None
    ) -> list[int] | None:
        """Found with a sentinel: the first new message's content is marked with a private-use character no
        string holds, the whole conversation rendered, and the delta runs from the last end-of-turn marker
        before the mark (the end of the turn before the new messages) to the end, the mark left out."""
        if not turns or not 0 < new_from < len(messages):
            return None
        plain = self._plain(messages)
        used = set().union(*strings_in(plain), *strings_in(tools), self._template)
        mark = next(chr(c) for block in PRIVATE_USE for c in block if chr(c) not in used)
        plain[new_from] = {**plain[new_from], "content": mark + plain[new_from]["content"]}
        literals = self._literals(plain, tools)
        full = self._render(plain, tools, literals, add_generation_prompt=True)
        at = full.find(mark)
        if at < 0 or full.count(mark) != 1:
            return None
        pos, end = max(((full.rfind(t, 0, at), t) for t in self._stop_texts), default=(-1, ""))
        if pos < 0:
            return None
        sampled = turns[-1][1]
        start = pos + len(end) if sampled and sampled[-1] in self._stop_ids else pos
        return self._encode_marked(full[start:at] + full[at + 1:], literals)

    def call_opener(self, fmt: ToolCallFormat, name: str | None = None) -> list[int] | None:
        """The convention's opener (SmolLM2's array form where rein's tools prompt asked for it), its markers as
        the template's ids (``<tool_call>`` is one added token in Qwen-family tokenizers) and ``name`` as text."""
        literals = Literals(self._special, [name or ""], [self._template])
        text = call_opener(fmt, None if name is None else literals.hide(name), array=not self.template_knows_tools)
        return None if text is None else self._encode_marked(text, literals)

    def continue_chat(self, turns: Sequence[Turn], messages: Messages, *, tools: Tools = None) -> list[int] | None:
        """In text space: the template's text for ``messages`` must start with what ``turns`` stand for;
        the rest is encoded. Contexts are compared by their exact text, marker for marker (a special id
        is its spelling, the same spelling in text is content: both sides hide it alike), sampled ids by
        :meth:`decode` of them (the answer the agent got; specials it never saw are dropped), and a
        final stop id matches whichever end-of-turn token the template writes there. Comparing text,
        not ids, is what lets the sampled ids stay verbatim: BPE would often split the assistant's text
        differently than the model sampled it."""
        if not turns:
            return None
        plain = self._plain(messages)
        contexts = [self._seen(context) for context, _ in turns]
        stopped = [bool(sampled) and sampled[-1] in self._stop_ids for _, sampled in turns]
        answers = [self._answer(s[:-1] if stop else s) for (_, s), stop in zip(turns, stopped, strict=True)]
        pieces = [(text, verbatim) for seen in (*contexts, *answers) for text, verbatim in seen]
        literals = self._literals(plain, tools, [t for t, verbatim in pieces if not verbatim],
                                  avoid=[t for t, verbatim in pieces if verbatim])
        full = self._render(plain, tools, literals, add_generation_prompt=True)
        pos = 0
        for seen, answer, stop in zip(contexts, answers, stopped, strict=True):
            text = "".join(piece if verbatim else literals.hide(piece) for piece, verbatim in seen)
            if not full.startswith(text, pos):
                return None
            pos += len(text)
            for piece, marker in answer:
                # a sampled added token reads back as the template's marker (a tool call echoed as tool_calls)
                # or as the content the agent echoed (where the request's strings hide it)
                found = next((t for t in ((piece, literals.hide(piece)) if marker else (literals.hide(piece),))
                              if full.startswith(t, pos)), None)
                if found is None:
                    return None
                pos += len(found)
            if stop:
                end = next((t for t in self._stop_texts if full.startswith(t, pos)), None)
                if end is None:
                    return None
                pos += len(end)
        return self._encode_marked(full[pos:], literals) if pos < len(full) else None

    def _literals(
        self,
        plain: list[dict[str, Any]],
        tools: Tools,
        seen: Sequence[str] = (),
        avoid: Sequence[str] = (),
    ) -> Literals:
        """Stand-ins for the special tokens spelled in the request's strings and in ``seen`` (text of
        earlier turns, to be hidden alike), found in none of them, ``avoid`` and the template's source."""
        return Literals(self._special, [*strings_in(plain), *strings_in(tools), *seen], [self._template, *avoid])

    def _render(
        self,
        plain: list[dict[str, Any]],
        tools: Tools,
        literals: Literals,
        *,
        add_generation_prompt: bool,
    ) -> str:
        """The template's text for the request's strings with their special-token spellings hidden: a
        spelling in it is a marker the template wrote."""
        if tools and not self.template_knows_tools:
            plain, tools = with_tools_prompt(plain, tools), None
        try:
            text = self.inner.apply_chat_template(
                literals.hide_in(plain),
                tools=literals.hide_in([dict(t) for t in tools]) if tools else None,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
            )
        except TemplateError as exc:  # the template's own raise_exception(...), or a malformed message
            raise UnrenderableMessages(f"the chat template cannot render these messages: {exc}") from None
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template returned {type(text).__name__}, expected text")
        return text

    def _encode_marked(self, rendered: str, literals: Literals) -> list[int]:
        """Ids of a :meth:`_render` text: as the tokenizer reads it when no content spelled a special token
        (the common case, exactly as before); else its markers' ids and the text between two markers
        encoded on its own, with special-token splitting off (the tokenizer too encodes the text between
        two special tokens on its own, and the deltas of :meth:`continue_chat` rely on it)."""
        if not literals.hidden_in(rendered):
            return self._encode(rendered)
        ids: list[int] = []
        for piece, marker in literals.split(rendered):
            ids.extend([self._markers[piece]] if marker else self._encode(piece, as_text=True))
        return ids

    def _answer(self, sampled: Sequence[int]) -> list[tuple[str, bool]]:
        """The answer the agent got for ``sampled`` (:meth:`decode`), in pieces: ``(spelling, True)`` for each
        non-special added token the model sampled, ``(text, False)`` between. One piece without such a token."""
        if not self._kept.intersection(sampled):
            return [(self.decode(sampled), False)]
        return self._split(sampled, self._kept, self.decode)

    def _seen(self, context: Sequence[int]) -> list[tuple[str, bool]]:
        """``context``'s exact text in pieces: ``(text, True)`` to compare verbatim (a special id's
        spelling is a marker), ``(text, False)`` to hide first (text between two special ids that spells
        special tokens, as content may). One piece, its whole text, unless some content spelled one."""
        text = self._text(context)
        if len(self._special.find(text)) == sum(i in self._spellings for i in context):
            return [(text, True)]
        return self._split(context, self._spellings.keys(), self._text)

    def _split(
        self, ids: Sequence[int], marks: Container[int], text: Callable[[Sequence[int]], str]
    ) -> list[tuple[str, bool]]:
        """``ids`` in pieces: ``(spelling, True)`` for each id in ``marks``, ``(text(run), False)`` for each
        run of ids between them (what :meth:`_answer` and :meth:`_seen` compare)."""
        pieces: list[tuple[str, bool]] = []
        start = 0
        for k, i in enumerate(ids):
            if i in marks:
                if k > start:
                    pieces.append((text(ids[start:k]), False))
                pieces.append((self._spellings[i], True))
                start = k + 1
        if start < len(ids):
            pieces.append((text(ids[start:]), False))
        return pieces

    def _text(self, ids: Sequence[int]) -> str:
        """Exact text of rendered ids: special tokens spelled out, no space clean-up."""
        return str(self.inner.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False))

    def _encode(self, text: str, *, as_text: bool = False) -> list[int]:
        """``text``'s ids without added BOS/EOS; ``as_text``: added-token spellings in it stay text."""
        if as_text and self._as_text is not None:
            return list(self._as_text.encode(text, add_special_tokens=False).ids)
        options = {"split_special_tokens": True} if as_text else {}
        ids = self.inner.encode(text, add_special_tokens=False, **options)
        out = [i for i in ids if isinstance(i, int)]
        if len(out) != len(ids):
            raise TypeError("encode returned something other than token ids")
        return out

    def decode(self, ids: Sequence[int]) -> str:
        text = self.inner.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return str(text)


def _without_added(tokenizer: PreTrainedTokenizerBase, drop: frozenset[int]) -> Tokenizer:
    """``tokenizer``'s fast backend without the added tokens ``drop`` and reading special ones as text: the ids
    of content. ``split_special_tokens`` splits only *special* added tokens; the others would still be read
    as one token each."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        raise ModelError(f"tokenizer {tokenizer.name_or_path!r} adds tokens that are not special and has no fast "
                         "backend to encode their spellings as text")
    doc = json.loads(backend.to_str())
    doc["added_tokens"] = [t for t in doc.get("added_tokens", []) if t.get("id") not in drop]
    plain = Tokenizer.from_str(json.dumps(doc))
    plain.encode_special_tokens = True
    return plain
