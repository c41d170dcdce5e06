"""Special-token spellings in a request's text, told apart from the chat template's own markers.

A chat template writes its markers (``<|im_start|>``, ``<|im_end|>``) as text, and a tokenizer
reading that text turns every spelling of a special token into its id: content that spells one
(a user's text, a web page a tool returned) would close its turn and forge another. So before
rendering, each spelling in the request's strings is swapped for a *stand-in*, a private-use
character found in none of them. In the rendered text a spelling is then a marker the template
wrote, and a stand-in is content, to be encoded as plain text. Pure: no tokenizer here.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Iterator, Mapping
from typing import Any

PRIVATE_USE = (range(0xE000, 0xF900), range(0xF0000, 0xFFFFE), range(0x100000, 0x10FFFE))
"""Unicode's private-use code points: no tokenizer or template gives them a meaning."""


def strings_in(value: Any) -> Iterator[str]:
    """Every string in ``value`` (mapping keys and values, sequence items, nested): what :meth:`Literals.hide_in`
    rewrites."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from strings_in(key)
            yield from strings_in(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from strings_in(item)


class Spellings:
    """A tokenizer's special tokens, matched in text leftmost-longest as a tokenizer matches its added tokens."""

    def __init__(self, spellings: Collection[str]) -> None:
        ordered = sorted(spellings, key=len, reverse=True)  # at one position, the longest spelling wins
        self.pattern = re.compile("|".join(map(re.escape, ordered)) if ordered else "(?!)")  # (?!) matches nothing

    def find(self, text: str) -> list[str]:
        return self.pattern.findall(text)


class Literals:
    """Stand-ins for the special tokens spelled in ``texts``.

    A stand-in is a private-use character found in none of ``texts`` and ``avoid`` (the template's
    source, other text it will be compared with), so hiding and revealing are exact inverses and a
    stand-in never means anything else.
    """

    def __init__(self, spellings: Spellings, texts: Iterable[str], avoid: Iterable[str] = ()) -> None:
        self._pattern = spellings.pattern
        texts = list(texts)
        found = sorted({s for text in texts for s in spellings.find(text)})
        self._hide: dict[str, str] = {}
        if found:
            used = set().union(*texts, *avoid)
            free = (chr(c) for block in PRIVATE_USE for c in block if chr(c) not in used)
            self._hide = dict(zip(found, free, strict=False))
            if len(self._hide) < len(found):
                raise ValueError("the request uses every private-use character: none is left to stand in for a "
                                 "special token")
        self._reveal = {ord(char): spelling for spelling, char in self._hide.items()}

    def hide(self, text: str) -> str:
        """``text`` with each spelling found in ``texts`` replaced by its stand-in (others, rein's own text such
        as a tools prompt, stay markers)."""
        if not self._hide:
            return text
        return self._pattern.sub(lambda m: self._hide.get(m.group(), m.group()), text)

    def hide_in(self, value: Any) -> Any:
        """``value`` with :meth:`hide` applied to every string in it (mappings become dicts, sequences lists)."""
        if isinstance(value, str):
            return self.hide(value)
        if isinstance(value, Mapping):
            return {self.hide_in(key): self.hide_in(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return [self.hide_in(item) for item in value]
        return value

    def reveal(self, text: str) -> str:
        """``text`` with each stand-in replaced by its spelling: the inverse of :meth:`hide`."""
        return text.translate(self._reveal) if self._reveal else text

    def hidden_in(self, text: str) -> bool:
        """Whether ``text`` holds a stand-in (content that spelled a special token)."""
        return any(chr(char) in text for char in self._reveal)

    def split(self, rendered: str) -> list[tuple[str, bool]]:
        """A rendering of hidden strings cut at its markers: ``(spelling, True)`` for each marker, ``(text, False)``
        for the revealed text between two (empty ones left out)."""
        pieces: list[tuple[str, bool]] = []
        pos = 0
        for match in self._pattern.finditer(rendered):
            if match.start() > pos:
                pieces.append((self.reveal(rendered[pos : match.start()]), False))
            pieces.append((match.group(), True))
            pos = match.end()
        if pos < len(rendered):
            pieces.append((self.reveal(rendered[pos:]), False))
        return pieces
