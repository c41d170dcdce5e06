"""The proxy's engines: their handles, the routing table (:mod:`services.proxy.routing`) and the
watch that keeps the table true.

Every ``engine_health_interval_s`` the watch calls each known engine's ``GET /health`` (rein's engine
and SGLang both serve it) and, with ``discover_engines``, reads the engines registered in Redis: a new
one is asked its version and context window and then takes sessions; one whose registration lapsed
takes none. A failed call counts like a failed check. When an engine turns unhealthy or leaves, its calls
in flight are cut (they fail as ``engine_unavailable`` at once instead of waiting out
``engine_timeout_s``), so a session on a dead engine is rejected on record, never left hanging.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from services.proxy.engine_client import EngineHandle
from services.proxy.routing import EngineTable
from services.proxy.session_machine import Session
from shared import log
from shared.errors import EngineError, EngineLost, EngineUnavailable
from shared.membership import Members
from shared.outage import DEPENDENCY_ERRORS

_log = log.get(__name__)


class EnginePool:
    def __init__(
        self,
        fixed: Sequence[EngineHandle],
        new_handle: Callable[[str], EngineHandle] | None = None,
        members: Members | None = None,
        unhealthy_after: int = 2,
    ) -> None:
        self.handles: dict[str, EngineHandle] = {h.url: h for h in fixed}
        self.table = EngineTable(list(self.handles), unhealthy_after)
        self._new_handle = new_handle
        self.members = members
        """Where registered engines are read (None: the fixed engines only)."""

    # ------------------------------------------------------------------ sessions

    def route(self, session: Session) -> EngineHandle:
        """The engine of the session's call (it sticks to it); :class:`~shared.errors.EngineLost` when the
        session holds tokens of an engine gone unhealthy or unregistered."""
        url = self.table.route(session.session_id, session.engine, holds_tokens=session.num_chunks > 0)
        if url != session.engine:
            if session.engine:
                self.table.unstick(session.engine)
            self.table.stick(url)
            session.engine = url
        return self.handles[url]

    def adopt(self, session: Session) -> None:
        """A session taken over from another replica sticks to its engine here too (its tokens are there)."""
        if session.engine:
            self.table.stick(session.engine)

    def release(self, session: Session) -> None:
        """The session ended: its engine has one session less."""
        if session.engine:
            self.table.unstick(session.engine)

    def call_failed(self, session: Session, error: EngineUnavailable) -> EngineUnavailable:
        """A call of ``session`` could not reach its engine: counted against the engine. When that took
        the engine out and the session holds its tokens, the session is lost (:class:`EngineLost`)."""
        url = str(error.fields.get("engine") or session.engine)
        if url not in self.handles:
            return error
        self.failed(url, str(error))
        if url == session.engine and session.num_chunks > 0 and not self.table.entries[url].routable:
            return EngineLost(f"engine {url} of session {session.session_id} is unreachable ({error.message}); "
                              "the session, which holds its tokens, is lost", session_id=session.session_id, engine=url)
        return error

    def standing(self, url: str) -> dict[str, object]:
        """What the table says of ``url`` (for the proxy's state); a registered engine that has not answered
        yet is not in it."""
        e = self.table.entries.get(url)
        if e is None:
            return {"healthy": False, "fixed": False, "registered": False, "sessions": 0}
        return {"healthy": e.healthy, "fixed": e.fixed, "registered": e.registered, "sessions": e.sessions}

    def handle(self, url: str) -> EngineHandle:
        return self.handles[url]

    def routable(self) -> list[EngineHandle]:
        return [self.handles[u] for u in self.table.routable()]

    def all(self) -> list[EngineHandle]:
        return [self.handles[u] for u in sorted(self.handles)]

    # ------------------------------------------------------------------ health

    def failed(self, url: str, error: str) -> None:
        """A call to ``url`` could not reach it (or a health check failed)."""
        if self.table.checked(url, ok=False):
            _log.warning("engine_unhealthy", engine=url, error=error)
            self.handles[url].cut()

    def answered(self, url: str) -> None:
        if self.table.checked(url, ok=True):
            _log.info("engine_healthy", engine=url)

    async def check(self) -> None:
        """One round: read the registered engines (admitting the new ones that answer), then check every
        known engine's health."""
        if self.members is not None:
            await self._discover(self.members)
        urls = [u for u, e in self.table.entries.items() if e.fixed or e.registered]
        results = await asyncio.gather(*(self.handles[u].check() for u in urls), return_exceptions=True)
        for url, result in zip(urls, results, strict=True):
            if isinstance(result, BaseException):
                self.failed(url, str(result))
            else:
                self.answered(url)

    async def _discover(self, members: Members) -> None:
        try:
            live = await asyncio.to_thread(members.live)
        except DEPENDENCY_ERRORS as exc:
            _log.warning("engines_not_read", error=str(exc))  # the table stays as it was
            return
        new, left = self.table.registered(live)
        for url in left:  # a dead engine's registration may lapse before its health checks fail
            _log.warning("engine_left", engine=url)
            self.handles[url].cut()
        for url in new:
            if url not in self.handles:
                assert self._new_handle is not None, "a pool that reads registered engines makes handles"
                self.handles[url] = self._new_handle(url)
            try:
                await self.handles[url].refresh()
            except (EngineUnavailable, EngineError) as exc:
                _log.warning("registered_engine_not_answering", engine=url, error=str(exc))
                continue
            self.table.joined(url)
            _log.info("engine_joined", engine=url, version=self.handles[url].version,
                      context_window=self.handles[url].context_window)

    async def watch(self, interval_s: float) -> None:
        """Check every ``interval_s`` until cancelled (the first round ``interval_s`` after start, which
        checked already)."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.check()
            except Exception:  # one bad round must not end the watch
                _log.exception("engine_check_failed")
