"""The rollout runner: dispatches groups of episodes through the proxy, forever or N times.

Consumes ``rollout.retries`` (consumer group; a record is done, and its offset
committable, once the retry's group is dispatched) and, in sync mode, ``weights``
(``WeightApplied`` opens the next wave).
Produces ``GroupDispatched`` on ``rollout.events`` — acked by Kafka *before* the
group's sessions start, so the collector always knows a group before its chunks.
Owns the prompt cursor in Redis (``RedisKeys.prompt_cursor``): each new prompt is
claimed from a shared counter before its group is dispatched, so a restarted runner
continues the seed's stream after the last claimed prompt (a prompt claimed but never
dispatched is skipped, never repeated), and uncommitted retries are re-read from Kafka.

Lifecycle: wait for the proxy and Kafka (bounded) → dispatch loop (the
:class:`~services.rollout.scheduler.Scheduler` decides) → on SIGTERM/SIGINT or when
``max_groups`` groups have been dispatched: stop dispatching, let in-flight groups end
(bounded by ``drain_timeout_s``), exit. A Kafka consumer thread that dies, a group task
that raises, or a proxy that stays unreachable ends the run with an error naming it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import redis
from kafka.errors import KafkaError
from prometheus_client import CollectorRegistry

from services.rollout.agent import Agent, EpisodeResult, SessionIds
from services.rollout.observe import RolloutMetrics
from services.rollout.scheduler import (
    AVAILABILITY_ERRORS,
    BackendGate,
    PromptStream,
    RetrySource,
    Scheduler,
    Work,
    retry_work,
)
from services.rollout.settings import RolloutSettings
from services.rollout.task import Task
from services.rollout.tasks import TASKS
from shared import log
from shared.bus import BusUnavailable, Consumer, Polled, Producer, ensure_topology
from shared.names import RedisKeys
from shared.outage import DEPENDENCY_ERRORS, Outage
from shared.schemas import DecodeError, GroupDispatched, RetryRequest, SessionRejected, WeightApplied, new_id
from shared.settings import KafkaSettings
from shared.state import connect
from shared.status_server import StatusServer

_log = log.get(__name__)

MAX_PUBLISH_FAILURES = 5
"""Consecutive GroupDispatched publish failures (each bounded by Kafka's request timeout) before giving up."""
LOST_SESSION = "session_lost"
"""``SessionRejected.error`` of a session the runner ended because its proxy never confirmed an end."""


class ProxyUnavailable(RuntimeError):
    """The proxy did not answer ``/health`` within the configured bound."""


class KafkaFeed:
    """One Kafka consumer on its own thread (kafka-python clients are not thread-safe).

    Records go to ``deliver`` on the event loop, and rebalances to ``on_revoked`` through
    the same FIFO, so a revoke is handled before any record of the next assignment.
    Positions the loop marks done are applied, and committed, on the consumer's thread.
    ``ready`` is set once the consumer has read every record that existed when it got its
    partitions (so history is known before dispatch).
    """

    def __init__(
        self,
        name: str,
        kafka: KafkaSettings,
        topics: list[str],
        group_id: str | None,
        loop: asyncio.AbstractEventLoop,
        deliver: Callable[[Polled], None],
        on_error: Callable[[BaseException], None],
        on_decode_error: Callable[[str, int, int, DecodeError], None],
        on_revoked: Callable[[set[tuple[str, int]]], None] | None = None,
    ) -> None:
        self.name = name
        self.ready = threading.Event()
        self._kafka, self._topics, self._group_id = kafka, topics, group_id
        self._loop, self._deliver, self._on_error, self._on_decode_error = loop, deliver, on_error, on_decode_error
        self._on_revoked = on_revoked
        self._stop = threading.Event()
        self._done: list[RetrySource] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"feed-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def done(self, sources: list[RetrySource]) -> None:
        """These records' work is durable; applied and committed on the consumer's thread."""
        with self._lock:
            self._done.extend(sources)

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def _call_loop(self, fn: Callable[..., Any], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop already closed: the runner is gone
            self._loop.call_soon_threadsafe(fn, *args)

    def _flush_commits(self, consumer: Consumer) -> None:
        with self._lock:
            done, self._done = self._done, []
        for source in done:
            consumer.done(source.topic, source.partition, source.offset)
        if self._group_id is not None:
            consumer.commit()

    def _revoked(self, tps: set[tuple[str, int]]) -> None:
        if self._on_revoked is not None:
            self._call_loop(self._on_revoked, tps)

    def _run(self) -> None:
        consumer: Consumer | None = None
        try:
            consumer = Consumer(
                self._kafka, self._topics, self._group_id, client_suffix=f"rollout-{self.name}",
                on_decode_error=lambda *a: self._call_loop(self._on_decode_error, *a),
                on_revoked=self._revoked,
            )
            targets: dict[Any, int] = {}
            next_report = time.monotonic() + 5.0
            while not self._stop.is_set():
                for polled in consumer.poll(0.2):
                    self._call_loop(self._deliver, polled)
                self._flush_commits(consumer)
                if not self.ready.is_set():
                    assignment = consumer.raw.assignment()
                    missing = [tp for tp in assignment if tp not in targets]
                    if missing:
                        targets.update(consumer.raw.end_offsets(missing))
                    if assignment and all(consumer.raw.position(tp) >= targets[tp] for tp in assignment):
                        self.ready.set()
                    elif time.monotonic() > next_report:
                        next_report = time.monotonic() + 5.0
                        _log.warning("feed_catching_up", feed=self.name, assigned=len(assignment),
                                     lag={f"{tp.topic}/{tp.partition}": targets[tp] - consumer.raw.position(tp)
                                          for tp in assignment})
            self._flush_commits(consumer)
        except BaseException as exc:  # a dead feed must stop the runner loudly (STYLE 5)
            self._call_loop(self._on_error, exc)
        finally:
            if consumer is not None:
                consumer.close()


class Runner:
    """Wires task, scheduler, agent, Kafka and metrics; see the module docstring."""

    def __init__(self, settings: RolloutSettings, task: Task | None = None) -> None:
        self.settings = settings
        self.task: Task = task or TASKS[settings.task]()
        self.log = log.get(__name__).bind(mode=settings.mode)
        self.metrics = RolloutMetrics(CollectorRegistry(auto_describe=True))
        self.stream = PromptStream(self.task.prompts(settings.seed), claimed=True)
        self.scheduler = Scheduler(
            self.stream,
            max_in_flight=settings.max_concurrent_groups,
            mode=settings.mode,
            groups_per_step=settings.groups_per_step,
            max_groups=settings.max_groups,
        )
        self.status_port: int | None = None
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopping = False
        self._ready = False
        self._fatal: BaseException | None = None
        self._proxy_suspect = False
        self._gate = BackendGate()
        self._publish_failures = 0
        self._feeds: list[KafkaFeed] = []
        self._retry_feed: KafkaFeed | None = None
        self._redis: redis.Redis | None = None
        self._cursor_key = RedisKeys(settings.redis.key_prefix).prompt_cursor(self.task.name, settings.seed)
        self._cursor_outage: Outage | None = None
        self._cursor_retry_at = 0.0

    # ------------------------------------------------------------------ control

    def stop(self) -> None:
        """Stop dispatching and drain (SIGTERM/SIGINT); a second call cancels in-flight groups."""
        if self._stopping:
            for task in self._tasks:
                task.cancel()
        self._stopping = True
        self._wake.set()

    def health(self) -> tuple[bool, dict[str, Any]]:
        s = self.scheduler
        detail: dict[str, Any] = {
            "status": "failed" if self._fatal else ("ok" if self._ready else "starting"),
            "mode": self.settings.mode, "dispatched": s.dispatched, "in_flight": s.in_flight,
            "pending_retries": s.pending_retries, "waiting_for_weights": s.waiting_for_weights,
            "weights_seq": s.weights_seq, "reward_mean": self.metrics.recent_reward_mean,
            "stopping": self._stopping,
        }
        return self._ready and self._fatal is None, detail

    def _fail(self, exc: BaseException) -> None:
        if self._fatal is None:
            self._fatal = exc
        self._wake.set()

    # ------------------------------------------------------------------ run

    async def run(self) -> None:
        """Run until stopped or ``max_groups`` is done; raises on a fatal error."""
        s = self.settings
        server = StatusServer(s.metrics_host, s.metrics_port, self.metrics.registry, self.health).start()
        self.status_port = server.port
        self.log.info("status_server_started", port=server.port)
        timeout = httpx.Timeout(s.request_timeout_s, connect=min(5.0, s.request_timeout_s))
        producer: Producer | None = None
        try:
            async with httpx.AsyncClient(timeout=timeout) as http, openai.AsyncOpenAI(
                base_url=f"{s.proxy_url}/v1", api_key=s.api_key, max_retries=0, timeout=s.request_timeout_s
            ) as client:
                agent = Agent(client, http, proxy_url=s.proxy_url, model=s.model, max_tokens=s.max_tokens,
                              temperature=s.temperature, finish_attempts=s.finish_attempts)
                await self._wait_proxy(http)
                self._redis = await asyncio.to_thread(connect, s.redis)
                producer = await asyncio.to_thread(self._connect_kafka)
                await self._start_feeds()
                self._ready = True
                self.log.info("runner_ready", proxy=s.proxy_url, group_size=s.group_size,
                              max_concurrent_groups=s.max_concurrent_groups, weights_seq=self.scheduler.weights_seq)
                try:
                    await self._dispatch_loop(agent, http, producer)
                finally:
                    await self._drain()
        finally:
            for feed in self._feeds:
                await asyncio.to_thread(feed.stop)
            if producer is not None:
                await asyncio.to_thread(producer.close)
            if self._redis is not None:
                self._redis.close()
            await asyncio.to_thread(server.stop)
        if self._fatal is not None:
            raise self._fatal

    async def _wait_proxy(self, http: httpx.AsyncClient) -> None:
        url = f"{self.settings.proxy_url}/health"
        deadline = time.monotonic() + self.settings.startup_timeout_s
        delay, last = 0.1, "no attempt"
        while True:
            try:
                response = await http.get(url, timeout=2.0)
                if response.status_code == 200:
                    return
                last = f"status {response.status_code}"
            except httpx.TransportError as exc:
                last = repr(exc)
            if time.monotonic() + delay > deadline:
                raise ProxyUnavailable(
                    f"proxy not healthy at {url} within {self.settings.startup_timeout_s}s ({last}); "
                    "check REIN_PROXY_URL and that `python -m services.proxy` is running"
                )
            self.log.warning("proxy_unavailable", url=url, error=last, retry_in_s=delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)

    def _connect_kafka(self) -> Producer:
        topics = self.settings.topics
        ensure_topology(self.settings.kafka, topics, only=[topics.events, topics.retries, topics.weights])
        return Producer(self.settings.kafka, client_suffix="rollout")

    async def _start_feeds(self) -> None:
        s, loop = self.settings, asyncio.get_running_loop()

        def decode_error(topic: str, _partition: int, _offset: int, exc: DecodeError) -> None:
            self.metrics.decode_errors.inc(topic, exc.reason)

        self._retry_feed = KafkaFeed("retries", s.kafka, [s.topics.retries], s.retry_consumer_group, loop,
                                     self._on_retry, self._fail, decode_error, self._on_retries_revoked)
        self._feeds.append(self._retry_feed)
        if s.mode == "sync":
            self._feeds.append(KafkaFeed("weights", s.kafka, [s.topics.weights], None, loop,
                                         self._on_weights, self._fail, decode_error))
        for feed in self._feeds:
            feed.start()
        for feed in self._feeds:
            caught_up = await asyncio.to_thread(feed.ready.wait, s.startup_timeout_s)
            if self._fatal is not None:
                raise self._fatal
            if not caught_up:
                raise BusUnavailable(
                    f"Kafka consumer of {feed.name!r} did not catch up within {s.startup_timeout_s}s "
                    f"(bootstrap {s.kafka.bootstrap_servers})"
                )

    # ------------------------------------------------------------------ feeds (on the loop)

    def _on_retry(self, polled: Polled) -> None:
        record = polled.record
        source = RetrySource(polled.topic, polled.partition, polled.offset)
        if not isinstance(record, RetryRequest) or not self._playable(record.prompt):
            self.log.error("retry_skipped", type=record.type, offset=polled.offset)
            self.metrics.bad_retries.inc()
            self._done([source])
            return
        work = retry_work(record.prompt_id, record.attempt, dict(record.prompt), source, record.free_retries)
        outcome = self.scheduler.add_retry(work)
        if outcome != "queued":
            self.log.info("retry_duplicate", prompt_id=record.prompt_id, attempt=record.attempt, outcome=outcome)
            self.metrics.duplicate_retries.inc()
        if outcome == "dispatched":
            self._done([source])
        self._wake.set()

    def _on_retries_revoked(self, tps: set[tuple[str, int]]) -> None:
        dropped = self.scheduler.revoke(tps)
        self.log.info("retries_revoked", partitions=sorted(f"{t}/{p}" for t, p in tps), queued_dropped=dropped)

    def _playable(self, payload: dict[str, Any]) -> bool:
        try:
            self.task.episode().reset(dict(payload))
        except ValueError:
            return False
        return True

    def _done(self, sources: list[RetrySource]) -> None:
        if sources and self._retry_feed is not None:
            self._retry_feed.done(sources)

    def _on_weights(self, polled: Polled) -> None:
        if isinstance(polled.record, WeightApplied):
            self.scheduler.on_weights_applied(polled.record.seq)
            self.metrics.weights_seq.set(self.scheduler.weights_seq)
            self._wake.set()

    # ------------------------------------------------------------------ dispatch

    async def _dispatch_loop(self, agent: Agent, http: httpx.AsyncClient, producer: Producer) -> None:
        s, sched = self.settings, self.scheduler
        wait_started: float | None = None
        while not self._stopping:
            if self._fatal is not None:
                return
            if self._proxy_suspect:
                self._proxy_suspect = False
                await self._wait_proxy(http)
            if not self._gate.may_dispatch(sched.in_flight):
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), 1.0)
                continue
            probe = self._gate.closed
            if probe:
                await asyncio.sleep(self._gate.delay_s)
                if self._stopping:
                    continue
            if not self.stream.available() and not sched.exhausted:
                await self._claim_prompt()
            work = sched.take()
            if work is None:
                if sched.finished:
                    self.log.info("max_groups_done", dispatched=sched.dispatched)
                    return
                timeout: float | None = None
                if not self.stream.available() and not sched.exhausted:  # the claim failed: Redis is down
                    timeout = max(0.0, self._cursor_retry_at - time.monotonic())
                if sched.waiting_for_weights:
                    wait_started = wait_started or time.monotonic()
                    timeout = s.sync_weight_timeout_s - (time.monotonic() - wait_started)
                    if timeout <= 0:
                        self.log.error("sync_weight_timeout", wave=sched.wave, waited_s=s.sync_weight_timeout_s,
                                       weights_seq=sched.weights_seq)
                        self.metrics.sync_wait_timeouts.inc()
                        sched.open_next_wave()
                        wait_started = None
                        continue
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout)
                continue
            wait_started = None
            self.metrics.sync_wave.set(sched.wave)
            if probe:
                self.metrics.probes.inc()
            await self._dispatch(work, agent, producer, probe)

    async def _claim_prompt(self) -> None:
        """Claim the next prompt index from the Redis cursor; a Redis outage is waited out (backoff)."""
        if time.monotonic() < self._cursor_retry_at or self._redis is None:
            return
        client = self._redis
        try:
            claimed = int(await asyncio.to_thread(client.incr, self._cursor_key))
        except DEPENDENCY_ERRORS as exc:
            self._cursor_outage = self._cursor_outage or Outage(self.log)
            self._cursor_retry_at = time.monotonic() + self._cursor_outage.failed(exc)
            return
        if self._cursor_outage is not None:
            self._cursor_outage.recovered()
            self._cursor_outage = None
        self.stream.claim(claimed - 1)
        self.metrics.prompt_cursor.set(claimed)

    async def _dispatch(self, work: Work, agent: Agent, producer: Producer, probe: bool = False) -> None:
        s = self.settings
        group_id = new_id("g")
        session_ids = [new_id("s") for _ in range(s.group_size)]
        record = GroupDispatched(group_id=group_id, prompt_id=work.prompt_id, attempt=work.attempt,
                                 free_retries=work.free_retries, session_ids=session_ids, prompt=work.payload)
        try:
            await asyncio.to_thread(producer.send, s.topics.events, record)
        except (BusUnavailable, KafkaError) as exc:
            self.scheduler.give_back(work)
            self.metrics.dispatch_failures.inc()
            self._publish_failures += 1
            if self._publish_failures >= MAX_PUBLISH_FAILURES:
                raise BusUnavailable(
                    f"could not publish GroupDispatched to {s.topics.events!r} at {s.kafka.bootstrap_servers} "
                    f"{MAX_PUBLISH_FAILURES} times in a row: {exc}"
                ) from exc
            self.log.warning("dispatch_failed", error=str(exc), attempt=self._publish_failures)
            await asyncio.sleep(min(2.0**self._publish_failures, 10.0))
            return
        self._publish_failures = 0
        self._done(self.scheduler.confirm(work))
        self.metrics.groups.labels(kind=work.kind).inc()
        self.metrics.in_flight.set(self.scheduler.in_flight)
        self.log.info("group_dispatched", group_id=group_id, prompt_id=work.prompt_id, attempt=work.attempt)
        task = asyncio.create_task(self._run_group(work, group_id, session_ids, agent, producer, probe))
        self._tasks.add(task)
        task.add_done_callback(self._group_done)

    async def _run_group(
        self, work: Work, group_id: str, session_ids: list[str], agent: Agent, producer: Producer, probe: bool
    ) -> None:
        try:
            results: list[EpisodeResult] = await asyncio.gather(*(
                agent.run(self.task.episode(), dict(work.payload),
                          SessionIds(sid, group_id, work.prompt_id, work.attempt))
                for sid in session_ids
            ))
            for result in results:
                self.metrics.on_episode(result)
            lost = [r for r in results if not r.on_record]
            if lost:
                await self._end_lost_sessions(group_id, lost, producer)
            if all(r.unreachable for r in results):
                self._proxy_suspect = True
            self._on_backend(all(r.outcome == "failed" and r.error in AVAILABILITY_ERRORS for r in results), probe)
            self.log.info("group_ended", group_id=group_id, prompt_id=work.prompt_id, attempt=work.attempt,
                          outcomes=[r.outcome for r in results], rewards=[r.reward for r in results])
        finally:
            self.scheduler.on_group_done()
            self.metrics.in_flight.set(self.scheduler.in_flight)
            self._wake.set()

    async def _end_lost_sessions(self, group_id: str, lost: list[EpisodeResult], producer: Producer) -> None:
        """Publish ``SessionRejected`` for sessions whose end the proxy never confirmed (it crashed,
        lost them, or could not write): without it their group would wait for an end that never
        comes. The collector takes a session's first end, so a duplicate of the proxy's is harmless."""
        records = [
            SessionRejected(session_id=r.session_id, group_id=group_id, error=LOST_SESSION,
                            detail={"outcome": r.outcome, "error": r.error}, num_chunks=None)
            for r in lost
        ]
        delay, attempt = 0.5, 0
        deadline = time.monotonic() + self.settings.lost_session_publish_s
        while True:
            attempt += 1
            try:
                await asyncio.to_thread(producer.send_many, [(self.settings.topics.events, r) for r in records])
            except (BusUnavailable, KafkaError) as exc:
                # Kafka is down (the proxy likely failed for the same reason): keep the group's slot
                # and try again, so dispatching slows down instead of leaving groups open.
                self.log.warning("lost_sessions_not_published", group_id=group_id, error=str(exc), attempt=attempt)
                if self._stopping or time.monotonic() + delay > deadline:
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
        was_closed = self._gate.closed
        self._gate.on_group(down, probe)
        self.metrics.backend_down.set(1 if self._gate.closed else 0)
        if self._gate.closed and not was_closed:
            self.log.warning("backend_down", note="dispatching one probe group at a time", delay_s=self._gate.delay_s)
        elif was_closed and not self._gate.closed:
            self.log.info("backend_back")

    def _group_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._fail(task.exception())  # type: ignore[arg-type]

    async def _drain(self) -> None:
        if not self._tasks:
            return
        self.log.info("draining", in_flight=len(self._tasks), timeout_s=self.settings.drain_timeout_s)
        _done, pending = await asyncio.wait(set(self._tasks), timeout=self.settings.drain_timeout_s)
        for task in pending:
            task.cancel()
        if pending:
            self.log.warning("groups_cancelled", count=len(pending))
            await asyncio.gather(*pending, return_exceptions=True)
