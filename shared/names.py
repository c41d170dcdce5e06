"""The one owner of topic names, Redis keys and on-disk paths.

Every service imports names from here so a rename happens in one place and the
compose file, the CLI and the tests cannot drift apart.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Topics(BaseModel):
    """Kafka topic names; configurable (``REIN_TOPICS__CHUNKS=...``), these are the defaults."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    chunks: str = "rollout.chunks"
    """One record per engine generation call (key: group id)."""
    events: str = "rollout.events"
    """Session finished / rejected, group dispatched (key: group id)."""
    groups: str = "rollout.groups"
    """Every completed group with full trajectories: the audit log replay reads (key: group id)."""
    batches: str = "train.batches"
    """Batch manifests (key: batch id)."""
    weights: str = "weights"
    """Weight version published / applied (key: version label)."""
    decisions: str = "staleness.decisions"
    """One window decision per completed group (key: group id)."""
    retries: str = "rollout.retries"
    """Retry requests for failed groups, consumed by the rollout runner (key: prompt id)."""

    def all(self) -> list[str]:
        return [self.chunks, self.events, self.groups, self.batches, self.weights, self.decisions, self.retries]

    def under(self, namespace: str) -> Topics:
        """These names under ``namespace``: a stack's own on a broker it shares (``ops.local.stack.SharedInfra``)."""
        return Topics(**{name: namespaced(topic, namespace) for name, topic in self.model_dump().items()})


def namespaced(name: str, namespace: str) -> str:
    """A topic or consumer group ``name`` under ``namespace`` (``""``: the name itself)."""
    return f"{namespace}.{name}" if namespace else name


class RedisKeys:
    """Redis key layout. ``prefix`` namespaces one deployment (tests use a fresh one each).

    Every key starts with the prefix as a hash tag (``{rein}:window``): on Redis Cluster all of a
    deployment's keys live in one slot, so the window's WATCH/MULTI step and the registry's scripts,
    which touch several keys at once, stay legal. A prefix that already holds a tag is used as is."""

    def __init__(self, prefix: str = "rein") -> None:
        self.prefix = prefix
        self.tag = prefix if "{" in prefix else f"{{{prefix}}}"
        """What every key starts with: the prefix as a hash tag."""

    @property
    def registry(self) -> str:
        """Hash label -> published sequence number."""
        return f"{self.tag}:versions:registry"

    @property
    def registry_order(self) -> str:
        """Sorted set label scored by sequence: ZRANK is the label's index, O(log n)."""
        return f"{self.tag}:versions:order"

    @property
    def unregistered(self) -> str:
        """Sorted set of labels seen in data but never published, scored by observation rank."""
        return f"{self.tag}:versions:unregistered"

    @property
    def unregistered_counter(self) -> str:
        """Counter giving the next observation rank of an unregistered label."""
        return f"{self.tag}:versions:unregistered_next"

    @property
    def window(self) -> str:
        """Hash with the window state: current label, current index, cumulative drop counters."""
        return f"{self.tag}:window"

    @property
    def pending(self) -> str:
        """Hash group id -> encoded pending group (kept groups waiting for the next batch)."""
        return f"{self.tag}:window:pending"

    @property
    def pending_order(self) -> str:
        """List of pending group ids in arrival order."""
        return f"{self.tag}:window:pending_order"

    @property
    def decided(self) -> str:
        """Hash group id -> decision name: makes each completed group's decision idempotent."""
        return f"{self.tag}:window:decided"

    @property
    def decided_at(self) -> str:
        """Sorted set group id scored by the unix time of its decision: what ``decided`` may forget, oldest first."""
        return f"{self.tag}:window:decided_at"

    def prompt_cursor(self, task: str, seed: int) -> str:
        """Counter of prompts claimed from the ``(task, seed)`` stream: a restarted runner (or another
        runner with the same seed) continues after the last claimed prompt, never repeats one."""
        return f"{self.prompt_cursors}{task}:seed{seed}"

    @property
    def prompt_cursors(self) -> str:
        """How every prompt cursor's name starts."""
        return f"{self.tag}:rollout:cursor:"

    @property
    def window_config(self) -> str:
        """Hash keep_versions / batch_groups / max_retries every collector replica must agree on."""
        return f"{self.tag}:window:config"

    def members(self, kind: str) -> str:
        """Sorted set of the live replicas of ``kind`` (``proxy``, ``engine``): URL scored by when its registration
        expires (unix seconds); each replica renews its own (``shared.membership``)."""
        return f"{self.tag}:members:{kind}"

    def session(self, session_id: str) -> str:
        """Hash of one proxy session for another replica to continue (owner, calls begun, the snapshot after
        the last call that ended, or how it ended; ``services.proxy.handoff``), expiring once it is idle."""
        return f"{self.tag}:session:{session_id}"

    @property
    def pause(self) -> str:
        """The broadcaster's pause in progress (JSON: pause id, reason), expiring with its lease: a proxy
        that starts meanwhile starts paused under it (``shared.pause_record``)."""
        return f"{self.tag}:pause"

    @property
    def replicated(self) -> str:
        """Counter written just before each Redis WAIT (``shared.state.Replication``)."""
        return f"{self.tag}:replicated"

    @property
    def outbox(self) -> str:
        """List of records a window step decided to publish (decisions, manifests, retries), in step order."""
        return f"{self.tag}:outbox"

    @property
    def outbox_lock(self) -> str:
        """Lease held by the one collector replica publishing the outbox (keeps manifests in index order)."""
        return f"{self.tag}:outbox:lock"
