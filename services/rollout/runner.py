"""The rollout runner: dispatches groups of episodes through the proxy, forever or N times.

Consumes ``rollout.retries`` (consumer group; a record is done, and its offset
committable, once the retry's group is dispatched) and, in sync mode, ``weights``
(``WeightApplied``, or ``BatchSkipped`` for a batch trained without an update, opens the next wave).
Produces ``GroupDispatched`` on ``rollout.events`` — acked by Kafka *before* the
group's sessions start, so the collector always knows a group before its chunks.
Owns the prompt cursor in Redis (``RedisKeys.prompt_cursor``): each new prompt is
claimed from a shared counter before its group is dispatched, so a restarted runner
continues the seed's stream after the last claimed prompt (a prompt claimed but never
dispatched is skipped, never repeated), and uncommitted retries are re-read from Kafka.

Lifecycle: wait for the proxy and Kafka (bounded) → dispatch loop (the
:class:`~services.rollout.scheduler.Scheduler` decides) → on SIGTERM/SIGINT or when
``max_groups`` groups have been dispatched: stop dispatching, let in-flight groups end
(bounded by ``drain_timeout_s``, and on a signal by half of ``stop_timeout_s``), exit. A Kafka
consumer thread that dies, a group task that raises, or a proxy that stays unreachable ends the
run with an error naming it.

This module is the process shell and the dispatch loop; what it reads from Kafka is in
:mod:`services.rollout.feeds`, how a dispatched group runs in :mod:`services.rollout.groups`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from typing import Any

import redis
from kafka.errors import KafkaError
from prometheus_client import CollectorRegistry

from services.rollout.agent import Agent
from services.rollout.command_agent import CommandAgent
from services.rollout.env_time import EnvTime
from services.rollout.feeds import Feeds
from services.rollout.groups import Groups
from services.rollout.observe import RolloutMetrics
from services.rollout.pacing import Pacer
from services.rollout.proxy_http import ProxyHttp, Timeout, Unreachable
from services.rollout.scheduler import BackendGate, PromptStream, Scheduler, Work
from services.rollout.settings import RolloutSettings
from services.rollout.task import Task
from services.rollout.tasks import TASKS
from shared import log
from shared.bus import BusUnavailable, Producer, ensure_topology
from shared.lender import Lender
from shared.names import RedisKeys
from shared.outage import DEPENDENCY_ERRORS, Backoff
from shared.schemas import GroupDispatched, new_id
from shared.staleness import Decision
from shared.state import connect
from shared.status_server import StatusServer
from shared.window_layout import WindowReader

PACING_READ_S = 0.05
"""How often a pacing runner re-reads the prompt cursor, the window's drops and its settings from Redis. A group
the window drops (a third of the untrained policy's groups have no signal) frees its place only once read, so
this bounds how long the place stays empty: at 0.5 s the demo's first 45 trainer steps took 26-42 % longer
(docs/benchmarks.md, "Where the CPU of a chat call goes"). Three small reads; a held runner makes 20 a second."""
SYNC_DROPS_READ_S = 0.1
"""How often a sync runner re-reads the window's count of groups dropped without signal (its wave's top-ups):
the trainer waits for the wave's last group, so a top-up read late is a step late."""
MAX_PUBLISH_FAILURES = 5
"""Consecutive GroupDispatched publish failures (each bounded by Kafka's request timeout) before giving up."""


HEALTH_TIMEOUT_S = 2.0
"""Bound on one ``GET /health`` of the proxy while waiting for it."""


class ProxyUnavailable(RuntimeError):
    """The proxy did not answer ``/health`` within the configured bound."""


class CredentialRefused(RuntimeError):
    """The proxy refused the runner's credential: no episode could be recorded."""


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
        self.pacer = Pacer(enabled=settings.mode == "async" and settings.pacing == "window")
        self.status_port: int | None = None
        self._wake = asyncio.Event()
        self._stopping = False
        self._ready = False
        self._fatal: BaseException | None = None
        self._gate = BackendGate()
        self._publish_failures = 0
        self._feeds = Feeds(settings, self.task, self.scheduler, self.pacer, self.metrics, self.log, self._wake.set,
                            self._fail)
        self._groups: Groups | None = None
        self._redis: redis.Redis | None = None
        self._keys = RedisKeys(settings.redis.key_prefix)
        self._cursor_key = self._keys.prompt_cursor(self.task.name, settings.seed)
        # Redis reads between other work: each its own pace and its own outage
        self._cursor_reads = Backoff(self.log)
        self._pacing_reads = Backoff(self.log, PACING_READ_S)
        self._drops_reads = Backoff(self.log, SYNC_DROPS_READ_S)

    # ------------------------------------------------------------------ control

    def stop(self) -> None:
        """Stop dispatching and drain (SIGTERM/SIGINT); a second call cancels in-flight groups."""
        if self._groups is not None:
            if self._stopping:
                self._groups.cancel()
            self._groups.stopping = True
        self._stopping = True
        self._wake.set()

    def health(self) -> tuple[bool, dict[str, Any]]:
        s = self.scheduler
        detail: dict[str, Any] = {
            "status": "failed" if self._fatal else ("ok" if self._ready else "starting"),
            "mode": self.settings.mode, "dispatched": s.dispatched, "in_flight": s.in_flight,
            "pending_retries": s.pending_retries, "waiting_for_weights": s.waiting_for_weights,
            "weights_seq": s.weights_seq, "reward_mean": self.metrics.recent_reward_mean,
            "pacing": {"live": self.pacer.live, "capacity": self.pacer.capacity,
                       "consumed_index": self.pacer.consumed_index} if self.pacer.enabled else None,
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
        producer: Producer | None = None
        try:
            # one for every client: each would load the CA bundle (~50 ms); only an https proxy needs it
            tls = ssl.create_default_context() if s.proxy_url.startswith("https:") else None
            runner = {"Authorization": f"Bearer {s.runner_token}"} if s.runner_token else {}
            clients = Lender(lambda: ProxyHttp(s.proxy_url, runner, s.request_timeout_s, tls))
            async with contextlib.AsyncExitStack() as opened:
                http = ProxyHttp(s.proxy_url, {}, HEALTH_TIMEOUT_S, tls)
                opened.push_async_callback(http.aclose)
                opened.push_async_callback(_close_all, clients)
                agent = (CommandAgent(clients, command=s.agent_command, timeout_s=s.agent_timeout_s,
                                      proxy_url=s.proxy_url, model=s.request_model, max_tokens=s.max_tokens,
                                      temperature=s.temperature, finish_attempts=s.finish_attempts)
                         if s.agent_command else
                         Agent(clients, proxy_url=s.proxy_url, model=s.request_model, max_tokens=s.max_tokens,
                               temperature=s.temperature, finish_attempts=s.finish_attempts,
                               env_time=EnvTime(s.env_time_median_s, s.env_time_sigma, s.seed)))
                await self._wait_proxy(http)
                await self._check_credential(clients)
                self._redis = await asyncio.to_thread(connect, s.redis)
                producer = await asyncio.to_thread(self._connect_kafka)
                await self._feeds.start()
                groups = self._groups = Groups(s, self.task, self.scheduler, self.metrics, self.log, self._gate,
                                               agent, producer, self._wake.set, self._fail)
                groups.stopping = self._stopping
                self._ready = True
                self.log.info("runner_ready", proxy=s.proxy_url, group_size=s.group_size,
                              max_concurrent_groups=s.max_concurrent_groups, weights_seq=self.scheduler.weights_seq)
                try:
                    await self._dispatch_loop(http, producer, groups)
                finally:
                    # stopped by a signal: half the stop's bound, the rest is for closing the clients
                    await groups.drain(min(s.drain_timeout_s, s.stop_timeout_s / 2) if self._stopping
                                       else s.drain_timeout_s)
        finally:
            await self._feeds.stop()
            if producer is not None:
                await asyncio.to_thread(producer.close)
            if self._redis is not None:
                self._redis.close()
            await asyncio.to_thread(server.stop)
        if self._fatal is not None:
            raise self._fatal

    async def _wait_proxy(self, http: ProxyHttp) -> None:
        url = f"{self.settings.proxy_url}/health"
        deadline = time.monotonic() + self.settings.startup_timeout_s
        delay, last = 0.1, "no attempt"
        while True:
            try:
                response = await http.get("/health")
                if response.status == 200:
                    return
                last = f"status {response.status}"
            except (Timeout, Unreachable) as exc:
                last = repr(exc)
            if time.monotonic() + delay > deadline:
                raise ProxyUnavailable(
                    f"proxy not healthy at {url} within {self.settings.startup_timeout_s}s ({last}); "
                    "check REIN_PROXY_URL and that `python -m services.proxy` is running"
                )
            self.log.warning("proxy_unavailable", url=url, error=last, retry_in_s=delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)

    async def _check_credential(self, clients: Lender[ProxyHttp]) -> None:
        """Open a session the way each episode will (minting a key changes no state): a proxy that refuses
        the runner's credential would otherwise fail every episode, one retry at a time."""
        with clients.use() as http:
            try:
                response = await http.post("/v1/sessions", {"group_id": "rein-credential-check"})
            except (Timeout, Unreachable):
                return  # it answered /health just now: the episodes meet whatever this is, and report it
        if response.status in (401, 403):
            raise CredentialRefused(
                f"the proxy refused the runner's credential ({response.status}: {str(response.body)[:200]}); set "
                "REIN_RUNNER_TOKEN to the proxies' value (or run the proxies with REIN_OPEN_SESSIONS=true)")

    def _connect_kafka(self) -> Producer:
        topics = self.settings.topics
        ensure_topology(self.settings.kafka, topics, only=[topics.events, topics.retries, topics.weights])
        return Producer(self.settings.kafka, client_suffix="rollout")

    # ------------------------------------------------------------------ dispatch

    async def _dispatch_loop(self, http: ProxyHttp, producer: Producer, groups: Groups) -> None:
        s, sched = self.settings, self.scheduler
        wait_started: float | None = None
        while not self._stopping:
            if self._fatal is not None:
                return
            if groups.proxy_suspect:
                groups.proxy_suspect = False
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
            await self._sync_drops()
            paced = False
            if not self.stream.available() and not sched.exhausted:
                paced = await self._pacing_holds()
                if not paced:
                    await self._claim_prompt()
            work = sched.take()
            if work is None:
                if sched.finished:
                    self.log.info("max_groups_done", dispatched=sched.dispatched)
                    return
                timeout: float | None = None
                if paced:  # capacity comes back with a version applied (a wake) or a drop (read from Redis)
                    timeout = PACING_READ_S
                elif not self.stream.available() and not sched.exhausted:  # the claim failed: Redis is down
                    timeout = max(0.0, self._cursor_reads.next_at - time.monotonic())
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
                if sched.mode == "sync":  # a group of the wave dropped without signal is topped up once read
                    timeout = SYNC_DROPS_READ_S if timeout is None else min(timeout, SYNC_DROPS_READ_S)
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout)
                continue
            wait_started = None
            self.metrics.sync_wave.set(sched.wave)
            if probe:
                self.metrics.probes.inc()
            await self._dispatch(work, producer, groups, probe)

    async def _claim_prompt(self) -> None:
        """Claim the next prompt index from the Redis cursor; a Redis outage is waited out (backoff)."""
        if not self._cursor_reads.due() or self._redis is None:
            return
        client = self._redis
        try:
            claimed = int(await asyncio.to_thread(client.incr, self._cursor_key))
        except DEPENDENCY_ERRORS as exc:
            self._cursor_reads.failed(exc)
            return
        self._cursor_reads.succeeded()
        self.stream.claim(claimed - 1)
        self.pacer.on_claimed(claimed)
        self.metrics.prompt_cursor.set(claimed)

    async def _pacing_holds(self) -> bool:
        """True while the admission bound holds the next new prompt back (services/rollout/pacing.py).

        Redis's counters are re-read at most every ``PACING_READ_S``; while Redis cannot be read, the
        last reading stands (the claim that would follow fails and backs off anyway)."""
        pacer = self.pacer
        if not pacer.enabled or self._redis is None:
            return False
        if self._pacing_reads.due():
            try:
                await asyncio.to_thread(self._read_pacing, self._redis)
            except DEPENDENCY_ERRORS as exc:
                self._pacing_reads.failed(exc)
            else:
                self._pacing_reads.succeeded()
        held = not pacer.admits()
        self.metrics.on_pacing(pacer.live, pacer.capacity, held)
        return held

    async def _sync_drops(self) -> None:
        """Sync mode: report the window's count of groups dropped without signal to the scheduler, which tops
        the wave up by as many (re-read at most every ``SYNC_DROPS_READ_S``; an outage keeps the last count)."""
        if self.settings.mode != "sync" or self._redis is None or not self._drops_reads.due():
            return
        reader = WindowReader(self._redis, self._keys)
        try:
            window = await asyncio.to_thread(reader.window)
        except DEPENDENCY_ERRORS as exc:
            self._drops_reads.failed(exc)
            return
        self._drops_reads.succeeded()
        self.scheduler.on_no_signal_drops(window.drops_by_reason.get(Decision.DROPPED_NO_SIGNAL.value, 0))

    def _read_pacing(self, client: redis.Redis) -> None:
        reader = WindowReader(client, self._keys)
        config = reader.config()
        keep, groups = config.get("keep_versions"), config.get("batch_groups")
        self.pacer.on_window(
            started=int(client.get(self._cursor_key) or 0),
            drops=reader.window().drops_total,
            keep_versions=keep if isinstance(keep, int) else None,
            batch_groups=groups if isinstance(groups, int) else None,
        )

    async def _dispatch(self, work: Work, producer: Producer, groups: Groups, probe: bool) -> None:
        """Publish the group's ``GroupDispatched`` (acked before any session starts), then run it."""
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
        self._feeds.done(self.scheduler.confirm(work))
        self.metrics.groups.labels(kind=work.kind).inc()
        self.metrics.in_flight.set(self.scheduler.in_flight)
        self.log.info("group_dispatched", group_id=group_id, prompt_id=work.prompt_id, attempt=work.attempt)
        groups.start(work, group_id, session_ids, probe)


async def _close_all(clients: Lender[ProxyHttp]) -> None:
    for client in clients.items:
        await client.aclose()
