"""Rollout runner settings (``REIN_*`` environment variables); built once in ``__main__``."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from services.rollout.tasks import TASKS
from shared.settings import ServiceSettings, StopSettings


class RolloutSettings(ServiceSettings, StopSettings):
    """Settings of ``python -m services.rollout``."""

    proxy_url: str = "http://127.0.0.1:8000"
    """Base URL of the proxy (without ``/v1``); agents call ``{proxy_url}/v1/chat/completions``."""
    runner_token: str = ""
    """The runner's credential at the proxy (the proxies' ``REIN_RUNNER_TOKEN``), sent as the bearer of every
    call that opens, drives by ``X-Session-Id`` or finishes a session. An agent command never gets it: only its
    session's key (docs/security.md). Empty only against a proxy with ``REIN_OPEN_SESSIONS=true``."""
    renamed: ClassVar[dict[str, str]] = {"REIN_MODEL": "REIN_REQUEST_MODEL"}

    request_model: str = "rein-tiny"
    """Model name put in each chat request (the proxy accepts any). Not ``REIN_MODEL``: that is the weights
    the engine, the proxy and the trainer load."""
    task: Annotated[str, TASKS] = "guess_number"
    """Task to play, by its name in ``services.rollout.tasks.TASKS``: ``guess_number`` for the tiny policy,
    ``arithmetic`` for an instruct model (``REIN_MODEL`` = a Hugging Face model; docs/task.md), ``calculator``
    for one that calls tools (docs/agents.md)."""
    seed: int = 0
    """Seed of the prompt stream: the same seed gives the same prompts (and prompt ids) in the same order."""
    group_size: int = Field(default=8, ge=1)
    """Episodes per prompt (one GRPO group); all of a group's episodes run concurrently."""
    max_concurrent_groups: int = Field(default=32, ge=1)
    """Most groups in flight at once (so at most ``max_concurrent_groups * group_size`` open chat calls)."""
    mode: Literal["async", "sync"] = "async"
    """``async``: keep ``max_concurrent_groups`` groups in flight continuously. ``sync`` (comparison
    runs): dispatch ``groups_per_step`` new groups, wait for all of them and for the next applied weight
    version, then the next wave; nothing new is dispatched while the trainer trains."""
    pacing: Literal["window", "off"] = "window"
    """Async mode: ``window`` starts a new prompt only while fewer than ``keep_versions * batch_groups``
    prompts (the collector's window settings in Redis) are started and not yet trained or dropped, so
    the engine generates what the trainer can still train inside the window (services/rollout/pacing.py).
    ``off``: only ``max_concurrent_groups`` bounds generation (the engine runs ahead of the trainer)."""
    groups_per_step: int = Field(default=32, ge=1)
    """Sync mode: new groups per wave. Set it to the trainer's groups per batch, or sync mode waits
    for an update that needs more groups than a wave gives (bounded by ``sync_weight_timeout_s``); for
    the same reason the collectors keep groups without signal (``REIN_NO_SIGNAL_GROUPS=keep``)."""
    sync_weight_timeout_s: float = Field(default=600.0, gt=0)
    """Sync mode: longest wait for the next applied weight version after a wave; past it the runner
    logs an error, counts ``rollout/sync_wait_timeouts`` and dispatches the next wave anyway."""
    max_groups: int = Field(default=0, ge=0)
    """Stop after dispatching this many groups (retries included), once they have all ended; 0 = unbounded."""
    max_tokens: int = Field(default=1, ge=1)
    """Output budget of each assistant reply. 1 (one word per reply, like the learning notes'
    prototype): an untrained policy then hits the secret with p = 1/54 per turn instead of about
    0.004 with 2 tokens, so about half the groups of 8 carry a learning signal from the start
    (docs/task.md). The proxy closes the assistant message with the end token either way."""
    temperature: float = Field(default=1.0, ge=0.0)
    """Sampling temperature of every call (RL samples at 1.0)."""
    env_time_median_s: float = Field(default=0.0, ge=0.0)
    """Seconds each environment step of rein's own agent loop waits, median (0: none): the time a tool call, a
    sandbox or a grader would take, spent without a core (``services/rollout/env_time.py``). Not applied to
    ``agent_command``, whose environment is its own."""
    env_time_sigma: float = Field(default=0.0, ge=0.0)
    """Log-normal sigma of that wait (0: every step waits the median; 1 and 2: ever longer tails)."""
    agent_command: list[str] = Field(default_factory=list)
    """A black-box agent to run for each episode instead of rein's own tool loop (JSON list, for example
    ``["llm", "openai", "endpoint", "{base_url}", "{prompt}", "-m", "m", "--key", "{api_key}"]``): it gets the
    session's base URL and key (``OPENAI_*`` / ``ANTHROPIC_*``) and the prompt; its stdout is graded
    (``services/rollout/command_agent.py``, docs/agents.md). Empty: rein's own agent loop."""
    agent_timeout_s: float = Field(default=600.0, gt=0)
    """Bound on one run of ``agent_command``; past it the command's process group is killed and the episode fails."""
    request_timeout_s: float = Field(default=120.0, gt=0)
    """Bound on one chat or finish call. A call held across a weight update (pause, load, resume)
    must fit inside it; past it the episode ends as failed."""
    finish_attempts: int = Field(default=3, ge=1)
    """Tries of the finish call when the proxy cannot be reached (a 409 after a lost answer is success)."""
    lost_session_publish_s: float = Field(default=300.0, gt=0)
    """How long the runner keeps trying to publish the end of sessions its proxy lost (Kafka down)
    before it gives up and leaves the group to the collector's ``incomplete_timeout_s``."""
    startup_timeout_s: float = Field(default=60.0, gt=0)
    """Bound on waiting for the proxy's ``/health`` and for the Kafka consumers to catch up at start,
    and on waiting for the proxy to come back when every episode of a group found it unreachable."""
    drain_timeout_s: float = Field(default=60.0, gt=0)
    """Once ``max_groups`` groups are dispatched: how long in-flight groups may still run before being cancelled.
    On SIGTERM/SIGINT the drain also ends at half of ``stop_timeout_s``; cancelled groups are retried."""
    retry_consumer_group: str = "rein-rollout"
    """Kafka consumer group reading ``rollout.retries`` (offsets are committed after a retry is dispatched)."""
    metrics_host: str = "127.0.0.1"
    """Interface of the ``/metrics`` and ``/health`` server."""
    metrics_port: int = Field(default=9500, ge=0, le=65535)
    """Port of ``/metrics`` and ``/health``; 0 picks a free port (logged as ``status_server_started``)."""

    @field_validator("proxy_url")
    @classmethod
    def _proxy_url(cls, url: str) -> str:
        url = url.strip().rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"proxy_url must be an http(s) URL, got {url!r}")
        if url.endswith("/v1"):
            raise ValueError(f"proxy_url is the proxy's base URL without /v1, got {url!r}")
        return url

    @model_validator(mode="after")
    def _sync_wave_fits(self) -> RolloutSettings:
        if self.mode == "sync" and 0 < self.max_groups < self.groups_per_step:
            raise ValueError(
                f"sync mode: max_groups ({self.max_groups}, REIN_MAX_GROUPS) is smaller than one wave "
                f"(groups_per_step = {self.groups_per_step}, REIN_GROUPS_PER_STEP)"
            )
        return self
