"""Which engine a session runs on, pure (no HTTP, no Redis): the proxy's table of engines.

Engines come from the settings (fixed: always known) and from Redis (registered: known while their
registration lives). Each is healthy or not, by its last health checks and calls: ``unhealthy_after``
failures in a row take it out, one success brings it back. A fixed engine starts healthy (as before
health checks existed); a registered one joins only once it answered.

A session sticks to its engine for its lifetime: its prefix is in that engine's cache and its tokens
carry that engine's version. It gets one at its first call (or while it holds no tokens yet): the
healthy engine with the fewest live sessions of this proxy, ties broken by a hash of the session id
and the engine (so proxies with equal loads spread sessions the same way). Once the session holds
tokens its engine is never changed: when that engine is unhealthy or gone the session is lost
(:class:`~shared.errors.EngineLost`, rejected on record by the proxy).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from shared.errors import EngineLost, EngineUnavailable


@dataclass
class EngineEntry:
    url: str
    fixed: bool
    """From the settings: never forgotten."""
    registered: bool = False
    """In Redis now (a registered engine that left is kept, not routable, for the sessions it held)."""
    healthy: bool = True
    failures: int = 0
    """Failed checks or calls since the last success."""
    sessions: int = 0
    """Live sessions of this proxy that stick to it (the load new sessions are balanced on)."""

    @property
    def routable(self) -> bool:
        return self.healthy and (self.fixed or self.registered)


class EngineTable:
    def __init__(self, fixed: Sequence[str], unhealthy_after: int = 2) -> None:
        if unhealthy_after < 1:
            raise ValueError(f"unhealthy_after must be >= 1, got {unhealthy_after}")
        self.unhealthy_after = unhealthy_after
        self.entries: dict[str, EngineEntry] = {url: EngineEntry(url, fixed=True) for url in fixed}

    # ------------------------------------------------------------------ what the engines did

    def registered(self, urls: Iterable[str]) -> tuple[list[str], list[str]]:
        """The registered engines now. Returns the new ones, which :meth:`joined` must admit once they
        answered (until then they get no sessions), and the ones that left (no longer routable)."""
        now = set(urls)
        left = sorted(e.url for e in self.entries.values() if e.registered and not e.fixed and e.url not in now)
        for url in left:
            self.entries[url].registered = False
        new = sorted(u for u in now if u not in self.entries or not (self.entries[u].registered or
                                                                       self.entries[u].fixed))
        return new, left

    def joined(self, url: str) -> None:
        """A registered engine answered: it takes sessions (a fixed one is only marked healthy)."""
        entry = self.entries.setdefault(url, EngineEntry(url, fixed=False))
        entry.registered = True
        self.checked(url, ok=True)

    def checked(self, url: str, ok: bool) -> bool:
        """A health check or a call to ``url`` succeeded or failed; True when its health changed."""
        entry = self.entries.get(url)
        if entry is None:
            return False
        before = entry.healthy
        entry.failures = 0 if ok else entry.failures + 1
        entry.healthy = ok or (entry.healthy and entry.failures < self.unhealthy_after)
        return entry.healthy != before

    # ------------------------------------------------------------------ sessions

    def route(self, session_id: str, current: str, holds_tokens: bool) -> str:
        """The engine of a session's call. ``current``: the one it sticks to ("" at its first call);
        ``holds_tokens``: the session already has tokens of it. Raises :class:`EngineLost` when it
        holds tokens of an engine that is no longer routable, :class:`EngineUnavailable` when no engine
        is. A session that moves (first call, or none of its tokens are there) is counted by :meth:`stick`."""
        entry = self.entries.get(current)
        if entry is not None and entry.routable:
            return current
        if current and holds_tokens:
            why = "failed its health checks" if entry is None or not entry.healthy else "left the registry"
            raise EngineLost(
                f"engine {current} of session {session_id} {why}; the session, which holds its tokens, is lost",
                session_id=session_id, engine=current,
            )
        candidates = [e for e in self.entries.values() if e.routable]
        if not candidates:
            raise EngineUnavailable(
                f"no healthy engine to start session {session_id} on "
                f"({len(self.entries)} known: {sorted(self.entries)})", session_id=session_id,
            )
        return min(candidates, key=lambda e: (e.sessions, _spread(session_id, e.url))).url

    def stick(self, url: str) -> None:
        """A session now sticks to ``url``."""
        if url in self.entries:
            self.entries[url].sessions += 1

    def unstick(self, url: str) -> None:
        """A session that stuck to ``url`` ended or moved."""
        entry = self.entries.get(url)
        if entry is not None and entry.sessions > 0:
            entry.sessions -= 1

    def routable(self) -> list[str]:
        return sorted(e.url for e in self.entries.values() if e.routable)


def _spread(session_id: str, url: str) -> bytes:
    return hashlib.sha256(f"{session_id}\0{url}".encode()).digest()[:8]
