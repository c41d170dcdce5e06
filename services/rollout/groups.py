"""Running dispatched groups: each group's episodes, what their outcomes say, and the tasks that run them.

A group's ``group_size`` sessions run concurrently through the :class:`~services.rollout.agent.Agent`.
When a group ends, its outcomes feed the metrics, the backend gate (every session failed for
lack of a dependency: slow down to probes) and the proxy check (every session found the proxy
unreachable); a session whose end the proxy never confirmed is ended here with a
``SessionRejected``, so its group does not wait for an end that never comes. A group task
that raises ends the run (``on_error``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog
from kafka.errors import KafkaError

from services.rollout.agent import Agent, EpisodeResult, SessionIds
from services.rollout.observe import RolloutMetrics
from services.rollout.scheduler import BackendGate, Scheduler, Work
from services.rollout.settings import RolloutSettings
from services.rollout.task import Task
from shared.bus import BusUnavailable, Producer
from shared.errors import BACKEND_DOWN_ERRORS, SESSION_LOST
from shared.schemas import SessionRejected


class Groups:
    """The groups in flight, each an asyncio task; see the module docstring."""

    def __init__(
        self,
        settings: RolloutSettings,
        task: Task,
        scheduler: Scheduler,
        metrics: RolloutMetrics,
        logger: structlog.stdlib.BoundLogger,
        gate: BackendGate,
        agent: Agent,
        producer: Producer,
        on_change: Callable[[], None],
        on_error: Callable[[BaseException], None],
    ) -> None:
        self.settings, self.task, self.scheduler, self.metrics, self.log = settings, task, scheduler, metrics, logger
        self.gate, self.agent, self.producer = gate, agent, producer
        self._on_change, self._on_error = on_change, on_error
        self.proxy_suspect = False
        """Every session of a group found the proxy unreachable: wait for it before the next dispatch."""
        self.stopping = False
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, work: Work, group_id: str, session_ids: list[str], probe: bool) -> None:
        """Run the dispatched group's episodes as a task."""
        task = asyncio.create_task(self._run(work, group_id, session_ids, probe))
        self._tasks.add(task)
        task.add_done_callback(self._ended)

    def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()

    async def drain(self, timeout_s: float) -> None:
        """Let the groups in flight end, for at most ``timeout_s``; then cancel the rest."""
        if not self._tasks:
            return
        self.log.info("draining", in_flight=len(self._tasks), timeout_s=timeout_s)
        _done, pending = await asyncio.wait(set(self._tasks), timeout=timeout_s)
        for task in pending:
            task.cancel()
        if pending:
            self.log.warning("groups_cancelled", count=len(pending))
            await asyncio.gather(*pending, return_exceptions=True)

    async def _run(self, work: Work, group_id: str, session_ids: list[str], probe: bool) -> None:
        try:
            results: list[EpisodeResult] = await asyncio.gather(*(
                self.agent.run(self.task.episode(), dict(work.payload),
                               SessionIds(sid, group_id, work.prompt_id, work.attempt, slot))
                for slot, sid in enumerate(session_ids)
            ))
            for result in results:
                self.metrics.on_episode(result)
            lost = [r for r in results if not r.on_record]
            if lost:
                await self._end_lost_sessions(group_id, lost)
            if all(r.unreachable for r in results):
                self.proxy_suspect = True
            self._on_backend(all(r.outcome == "failed" and r.error in BACKEND_DOWN_ERRORS for r in results), probe)
            self.log.info("group_ended", group_id=group_id, prompt_id=work.prompt_id, attempt=work.attempt,
                          outcomes=[r.outcome for r in results], rewards=[r.reward for r in results],
                          turns=[r.turns for r in results])
        finally:
            self.scheduler.on_group_done()
            self.metrics.in_flight.set(self.scheduler.in_flight)
            self._on_change()

    async def _end_lost_sessions(self, group_id: str, lost: list[EpisodeResult]) -> None:
        """Publish ``SessionRejected`` for sessions whose end the proxy never confirmed (it crashed,
        lost them, or could not write): without it their group would wait for an end that never
        comes. The collector takes a session's first end, so a duplicate of the proxy's is harmless."""
        records = [
            SessionRejected(session_id=r.session_id, group_id=group_id, error=SESSION_LOST,
                            detail={"outcome": r.outcome, "error": r.error}, num_chunks=None)
            for r in lost
        ]
        delay, attempt = 0.5, 0
        deadline = time.monotonic() + self.settings.lost_session_publish_s
        while True:
            attempt += 1
            try:
                await asyncio.to_thread(self.producer.send_many, [(self.settings.topics.events, r) for r in records])
            except (BusUnavailable, KafkaError) as exc:
                # Kafka is down (the proxy likely failed for the same reason): keep the group's slot
                # and try again, so dispatching slows down instead of leaving groups open.
                self.log.warning("lost_sessions_not_published", group_id=group_id, error=str(exc), attempt=attempt)
                if self.stopping or time.monotonic() + delay > deadline:
                    break
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)
                continue
            self.metrics.lost_sessions.inc(len(records))
            self.log.warning("lost_sessions_ended", group_id=group_id, sessions=[r.session_id for r in lost],
                             outcomes=[r.outcome for r in lost], errors=[r.error for r in lost])
            return
        self.metrics.lost_sessions_unpublished.inc(len(records))
        self.log.error("lost_sessions_unpublished", group_id=group_id, sessions=[r.session_id for r in lost],
                       note="the collector abandons the group after REIN_INCOMPLETE_TIMEOUT_S")

    def _on_backend(self, down: bool, probe: bool) -> None:
        was_closed = self.gate.closed
        self.gate.on_group(down, probe)
        self.metrics.backend_down.set(1 if self.gate.closed else 0)
        if self.gate.closed and not was_closed:
            self.log.warning("backend_down", note="dispatching one probe group at a time", delay_s=self.gate.delay_s)
        elif was_closed and not self.gate.closed:
            self.log.info("backend_back")

    def _ended(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._on_error(task.exception())  # type: ignore[arg-type]
