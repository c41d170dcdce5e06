"""Proxy settings (``REIN_*`` environment variables); built once in ``__main__``.

Lists are JSON: ``REIN_ENGINE_URLS='["http://engine-0:30000","http://engine-1:30000"]'``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from shared.settings import ModelServiceSettings, ReplicaSettings, StopSettings, http_urls


class ProxySettings(ModelServiceSettings, ReplicaSettings, StopSettings):
    """Settings of ``python -m services.proxy``.

    With ``REIN_ADVERTISE_URL`` the proxy registers itself in Redis (so replicas behind a load balancer
    need no ``REIN_PROXY_URLS`` at the broadcaster) and starts paused when an update is in progress."""

    host: str = "127.0.0.1"
    """Interface the HTTP server binds (0.0.0.0 inside a container)."""
    port: int = Field(default=8000, ge=1, le=65535)
    """HTTP port agents and the weight broadcaster call."""
    engine_urls: list[str] = Field(default_factory=lambda: ["http://127.0.0.1:30000"])
    """Base URLs of fixed inference engines (with ``discover_engines``, may be empty). A session sticks to
    one engine for its lifetime, the least loaded healthy one when it starts, so its prefix stays in that
    engine's cache and its version is that engine's version."""
    discover_engines: bool = False
    """Also route to the engines that registered themselves in Redis (an engine's ``REIN_ADVERTISE_URL``),
    checked every ``engine_health_interval_s``: one that joins gets new sessions once it answered, one
    whose registration lapses gets none."""
    engine_health_interval_s: float = Field(default=2.0, gt=0)
    """How often every engine's ``GET /health`` is called (and the registered engines read)."""
    engine_unhealthy_after: int = Field(default=2, ge=1)
    """Failed health checks (unreachable, no answer in time, a 5xx) or calls that could not reach the engine,
    in a row, after which an engine gets no new sessions and the sessions holding its tokens are rejected
    (``engine_lost``); one good check makes it healthy again."""
    admin_token: str = Field(min_length=8)
    """Bearer token of the control plane (pause / resume / state): the operator's. Required, no default:
    set REIN_ADMIN_TOKEN to the same value in the proxy and the weight broadcaster."""
    runner_token: str = ""
    """Bearer token of whoever runs the agents (the rollout runner): it alone opens sessions, finishes them
    (posts rewards) and drives a session by ``X-Session-Id``. Required unless ``open_sessions``; the same
    value in every proxy and the rollout runner. The agent never holds it (docs/security.md)."""
    open_sessions: bool = False
    """An open local set-up: anyone who reaches the proxy may open, drive and finish sessions (post
    rewards) without the runner token. An agent could then post its own reward: never for training runs."""
    session_key_secret: str = Field(min_length=16)
    """Secret that signs session keys (HMAC-SHA256): the same in every proxy replica, distinct from the
    tokens. Required, no default."""
    run_id: str = Field(min_length=1)
    """The run the proxy serves: a session key minted for another run is refused, even under the same secret.
    Required; the same in every proxy replica (the local stack and ``deploy/compose-env.sh`` make one)."""
    session_key_ttl_s: float = Field(default=86_400.0, gt=0)
    """How long a session key is valid after it is minted (longer than any episode)."""
    model_name: str = "rein-tiny"
    """Model id reported by ``GET /v1/models`` and in responses (requests may name any model)."""
    partial_rollout: bool = True
    """Continue a generation preempted by a weight update on the new weights. Off: a
    preempt is 502 ``generation_preempted`` and any version change in a session is 502
    ``trajectory_version_changed``."""
    max_preempts: int | None = Field(default=None, ge=0)
    """Span cap: a session may span at most ``max_preempts + 1`` distinct real versions. Unset or ``none``: no
    cap (``none`` also in ``rein up`` and ``make demo``). Negative values are refused at start."""
    soft_reject: bool = False
    """Answer the three staleness rejections with a 200 empty assistant message (the
    session is still rejected). Per request: header ``X-Rein-Soft-Reject: 1``."""
    context_window: int | None = Field(default=None, ge=2)
    """Tokens of prompt + output a generation may reach. None: each engine's own window, read
    once from its ``GET /get_server_info`` (the smaller of ``context_length`` and
    ``max_req_input_len``; SGLang reports ``context_length`` only when launched with
    ``--context-length``)."""
    default_max_tokens: int = Field(default=64, ge=1)
    """Output budget of a call that sets neither ``max_tokens`` nor ``max_completion_tokens``."""
    max_body_bytes: int = Field(default=1024 * 1024, ge=1024)
    """Largest request body accepted (declared Content-Length and bytes actually sent); 413 above."""
    engine_connect_timeout_s: float = Field(default=5.0, gt=0)
    """Bound on connecting to an engine; an unreachable engine is 503 ``engine_unavailable``."""
    engine_timeout_s: float = Field(default=300.0, gt=0)
    """Bound on one engine call (a whole chunk's generation); 503 ``engine_unavailable`` after it."""
    pause_timeout_s: float = Field(default=60.0, gt=0)
    """How long ``/v1/rollout/pause`` waits for in-flight generations to quiesce when the
    request does not say; past it the answer is ``quiesced: false``."""
    pause_lease_s: float = Field(default=60.0, gt=0)
    """How long a pause lasts without a renew when the pause request does not say. Past it the
    proxy resumes by itself on the versions its engines report (a broadcaster killed between
    pause and resume must not hold every agent forever); logged and counted."""
    abort_retry_s: float = Field(default=0.01, gt=0)
    """First delay before re-sending an abort that matched nothing on the engine (the
    abort overtook its ``/generate``); doubles up to 1 s, bounded by the pause timeout. Short:
    a retry is one call per engine for all such requests, and under load the 50 ms first delay
    made the retry chain (50 + 100 ms) the tail of the pause stall (docs/benchmarks.md)."""
    max_chunks_per_call: int = Field(default=64, ge=1)
    """Most engine calls one chat call may make (each preempt adds one); 502 ``engine_error``
    above, so an engine that aborts everything cannot loop a call forever."""
    temperature: float = Field(default=1.0, ge=0.0)
    """Sampling temperature of calls that do not set one (RL samples at 1.0)."""
    stream_heartbeat_s: float = Field(default=10.0, gt=0)
    """A streamed call (``stream: true``) still generating after this long is answered 200 at once and kept
    alive by an SSE comment this often until its frames are ready (an error then is a streamed
    ``{"error": ...}`` frame); one done sooner is answered as a whole, with its real status."""
    tool_call_parser: Literal["auto", "none", "hermes", "llama3_json", "mistral", "pythonic"] = "auto"
    """How a finished reply is split into content and OpenAI ``tool_calls`` (``shared/model/tool_calls.py``):
    ``auto`` follows the model's chat template (``hermes`` for one that shows no convention), ``none`` never
    parses. Markup that does not parse is returned as content."""
    rewritten_history: Literal["keep", "follow"] = "keep"
    """When the chat template renders a session's earlier turns otherwise than the engine saw them (Qwen3's drops
    earlier thinking once a new user message arrives): ``keep`` the session one segment (the engine is given
    its own earlier ids verbatim, each new message as the template renders it after them), or ``follow`` the
    template (a new segment per such call, its prompt the rewritten history). ``keep``: on a 5-turn episode
    of a Qwen3-style template, 633 trainer tokens in one sample against 1026 in five (docs/agents.md)."""
    session_idle_timeout_s: float = Field(default=900.0, ge=0)
    """A session with no call for this long is rejected (``session_idle``, published like any
    rejection, so its group is decided and retried). Its agent is gone: a crashed rollout runner,
    an agent that never calls finish. Keep it above the longest pause between an agent's calls
    (tool runs) and below the collector's ``incomplete_timeout_s``. 0 = never."""
    publish_max_inflight_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    """Encoded bytes of records submitted to Kafka and not yet acked that the proxy holds at most.
    Chunks are written without making the agent wait for the ack; past this bound a new chunk
    waits for room (back-pressure on the calls) instead of growing memory. One record larger
    than the bound is still written, alone."""
    session_handoff: bool = True
    """With ``advertise_url`` (replicas behind a balancer): keep each session's state in Redis after each call, so a
    replica that gets a call for a session it does not hold (its proxy died, or left the balancer's rotation)
    continues it token-exact; a session whose proxy stopped during a call is refused (``session_interrupted``).
    Off, or without ``advertise_url``: such a call starts the session anew and its finish gets 404
    (docs/reliability.md, "A proxy dies mid-session")."""
    finalized_memory: int = Field(default=100_000, ge=1)
    """How many finished/rejected session ids are remembered (for 409) after their data is dropped."""

    @field_validator("max_preempts", mode="before")
    @classmethod
    def _none_is_no_cap(cls, value: object) -> object:
        return None if isinstance(value, str) and value.strip().lower() == "none" else value

    @field_validator("engine_urls")
    @classmethod
    def _urls(cls, urls: list[str]) -> list[str]:
        return http_urls(urls, "engine_urls")

    @model_validator(mode="after")
    def _credentials(self) -> ProxySettings:
        if not self.open_sessions and len(self.runner_token) < 16:
            raise ValueError("runner_token: set REIN_RUNNER_TOKEN (16+ characters, the rollout runner's credential), "
                             "or REIN_OPEN_SESSIONS=true for an open local set-up where agents can post rewards")
        named = {"admin_token": self.admin_token, "runner_token": self.runner_token,
                 "session_key_secret": self.session_key_secret}
        values = [v for v in named.values() if v]
        if len(set(values)) != len(values):
            raise ValueError(f"{', '.join(named)} must differ: each role holds only its own")
        return self

    @model_validator(mode="after")
    def _some_engine(self) -> ProxySettings:
        if not self.engine_urls and not self.discover_engines:
            raise ValueError("no engine: set REIN_ENGINE_URLS, or REIN_DISCOVER_ENGINES=true for registered engines")
        return self
