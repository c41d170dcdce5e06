"""The session store: every live session of this proxy, by id, plus a bounded memory of ended ones.

Each session is a pure state machine (:mod:`services.proxy.session_machine`); the store
only finds it, marks it busy while a request drives it, and remembers how it ended.
Finished and rejected sessions drop their data; their ids are remembered (bounded)
so later calls get 409 instead of silently starting a new session. A session with no
call for the idle timeout is rejected too (``session_idle``): its agent is gone (a
crashed rollout runner, an agent that never calls finish), and without an end record
its group would hold the collector until its incomplete timeout and never be retried.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from services.proxy.session_machine import Session, VersionRules
from services.proxy.session_snapshot import restore
from services.proxy.transcript import RewrittenHistory, SegmentState, TurnPlan
from shared.errors import BadRequest, SessionBusy, SessionFinalized, SessionNotFound
from shared.model.chat import ChatTokenizer
from shared.model.tiny_chat import TinyChatTokenizer
from shared.model.tool_calls import ToolCallFormat

__all__ = ["SegmentState", "Session", "SessionStore", "TurnPlan"]


class SessionStore:
    """Live sessions by id, plus a bounded memory of finalized ids (for 409)."""

    def __init__(
        self, finalized_memory: int = 100_000, clock: Callable[[], float] = time.monotonic, *,
        tokenizer: ChatTokenizer | None = None, rules: VersionRules | None = None,
        tool_calls: ToolCallFormat | None = None, rewritten_history: RewrittenHistory = "keep",
    ) -> None:
        self._tokenizer = tokenizer or TinyChatTokenizer()
        self._rules = rules or VersionRules()
        self._tool_calls = self._tokenizer.tool_call_format if tool_calls is None else tool_calls
        self._rewritten_history: RewrittenHistory = rewritten_history
        self._live: dict[str, Session] = {}
        self._final: OrderedDict[str, str] = OrderedDict()
        self._memory = finalized_memory
        self._clock = clock

    def __len__(self) -> int:
        return len(self._live)

    def acquire(self, session_id: str, group_id: str, prompt_id: str = "", attempt: int = 0) -> Session:
        """The session for a chat call, created on first use, marked busy.

        409 when finalized or already in a call; 400 when the group id differs from
        the one the session started with.
        """
        self._raise_if_final(session_id)
        session = self._live.get(session_id)
        if session is None:
            session = Session(session_id=session_id, group_id=group_id, prompt_id=prompt_id, attempt=attempt,
                              tokenizer=self._tokenizer, rules=self._rules, tool_calls=self._tool_calls,
                              rewritten_history=self._rewritten_history)
            self._live[session_id] = session
        elif session.group_id != group_id:
            raise BadRequest(
                f"session {session_id} belongs to group {session.group_id!r}, not {group_id!r}",
                session_id=session_id, group_id=session.group_id, got=group_id,
            )
        if session.busy:
            raise SessionBusy(f"session {session_id} already has a call in flight", session_id=session_id)
        session.busy = True
        session.last_active = self._clock()
        return session

    def holds(self, session_id: str) -> bool:
        """Whether this proxy knows the session: live here, or ended here."""
        return session_id in self._live or session_id in self._final

    def adopt(self, snapshot: dict[str, Any]) -> Session:
        """Continue here a session another replica held (its :mod:`~services.proxy.session_snapshot`).
        Raises ``UnreadableSnapshot``, and ValueError for a session this proxy knows already."""
        session = restore(snapshot, self._template())
        if self.holds(session.session_id):
            raise ValueError(f"session {session.session_id} is known here already")
        session.last_active = self._clock()
        self._live[session.session_id] = session
        return session

    def _template(self) -> Session:
        return Session(session_id="", group_id="", tokenizer=self._tokenizer, rules=self._rules,
                       tool_calls=self._tool_calls, rewritten_history=self._rewritten_history)

    def release(self, session: Session) -> None:
        session.busy = False
        session.last_active = self._clock()

    def idle(self, timeout_s: float) -> list[Session]:
        """Live sessions with no call in flight and none started or ended for ``timeout_s``, oldest first."""
        cutoff = self._clock() - timeout_s
        stale = [s for s in self._live.values() if not s.busy and s.last_active <= cutoff]
        return sorted(stale, key=lambda s: s.last_active)

    def get(self, session_id: str) -> Session:
        """A live session; 409 when finalized, 404 when never seen."""
        self._raise_if_final(session_id)
        session = self._live.get(session_id)
        if session is None:
            raise SessionNotFound(f"no session {session_id} on this proxy: it made no call here, or this proxy "
                                  "restarted since; no end is recorded for it", session_id=session_id)
        return session

    def finalize(self, session: Session, outcome: str) -> None:
        """Drop the session's data; later calls with its id get 409 naming ``outcome``."""
        self._live.pop(session.session_id, None)
        self._final[session.session_id] = outcome
        self._final.move_to_end(session.session_id)
        while len(self._final) > self._memory:
            self._final.popitem(last=False)

    def outcome(self, session_id: str) -> str | None:
        return self._final.get(session_id)

    def _raise_if_final(self, session_id: str) -> None:
        outcome = self._final.get(session_id)
        if outcome is not None:
            raise SessionFinalized(
                f"session {session_id} is {outcome}; it takes no more calls", session_id=session_id, outcome=outcome
            )
