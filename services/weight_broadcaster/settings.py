"""Weight broadcaster settings (``REIN_*`` environment variables); built once in ``__main__``.

Lists are JSON, as in the proxy: ``REIN_PROXY_URLS='["http://127.0.0.1:8000"]'``.
"""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from shared.settings import ServiceSettings, StopSettings, http_urls


class BroadcasterSettings(ServiceSettings, StopSettings):
    """Settings of ``python -m services.weight_broadcaster``."""

    proxy_urls: list[str] = Field(default_factory=lambda: ["http://127.0.0.1:8000"])
    """Proxies to pause before and resume after a weight update, besides the ones that registered
    themselves in Redis (``REIN_ADVERTISE_URL``); may be empty: replicas behind a load balancer register."""
    engine_urls: list[str] = Field(default_factory=lambda: ["http://127.0.0.1:30000"])
    """Engines to load each new version, besides the ones registered in Redis (an engine's
    ``REIN_ADVERTISE_URL``); may be empty when the engines register. A fixed engine that fails an
    update fails the version; a registered one that does not answer is left out and reported
    (``engines_lagging``), then reconciled once it answers."""
    admin_token: str = Field(min_length=8)
    """Bearer token of the proxies' control plane; the same value as the proxies' REIN_ADMIN_TOKEN."""
    pause_timeout_s: float = Field(default=30.0, gt=0)
    """How long each proxy may wait for its in-flight generations to quiesce."""
    pause_lease_s: float = Field(default=30.0, gt=0)
    """Lease of each pause: a proxy that hears no renew for this long resumes by itself (so a
    broadcaster killed mid-update cannot hold every agent). Renewed every third of it while the
    engines update; a pause round that took over a third of it is renewed on every proxy before the
    update starts (a shorter one cannot have lost a lease)."""
    max_pause_attempts: int = Field(default=5, ge=1)
    """Pause rounds per version before giving it up (proxies are resumed between rounds)."""
    backoff_base_s: float = Field(default=0.5, ge=0)
    """Delay after the first failed pause round; doubles each round."""
    backoff_max_s: float = Field(default=10.0, ge=0)
    """Cap of the delay between pause rounds."""
    update_timeout_s: float = Field(default=120.0, gt=0)
    """Bound on one engine's ``/update_weights_from_disk`` call."""
    max_update_attempts: int = Field(default=3, ge=1)
    """Update calls per engine and version before the version is reported failed."""
    http_timeout_s: float = Field(default=10.0, gt=0)
    """Bound on the other HTTP calls (resume, renew, the engines' ``/get_model_info``)."""
    abort_all_requests: bool = False
    """Pass ``abort_all_requests`` to the engines (the proxies already aborted their requests when pausing)."""
    consumer_group: str = "rein-weight-broadcaster"
    """Kafka consumer group of the ``weights`` consumer; offsets are committed once a version is handled."""
    reconcile_interval_s: float = Field(default=5.0, gt=0)
    """How often every engine's version is checked; one serving an older version (it restarted)
    gets the newest applied version loaded again."""
    poll_timeout_s: float = Field(default=0.5, gt=0)
    """Longest wait of one Kafka poll; bounds how fast a stop request is noticed."""
    metrics_host: str = "127.0.0.1"
    """Interface of the ``/metrics`` and ``/health`` HTTP server."""
    metrics_port: int = Field(default=9401, ge=0, le=65535)
    """Port of ``/metrics`` and ``/health``; 0 picks a free port (tests)."""

    @field_validator("proxy_urls")
    @classmethod
    def _proxies(cls, urls: list[str]) -> list[str]:
        return http_urls(urls, "proxy_urls (REIN_PROXY_URLS)")

    @field_validator("engine_urls")
    @classmethod
    def _engines(cls, urls: list[str]) -> list[str]:
        return http_urls(urls, "engine_urls (REIN_ENGINE_URLS)")

    @model_validator(mode="after")
    def _check(self) -> BroadcasterSettings:
        if self.backoff_max_s < self.backoff_base_s:
            raise ValueError(
                f"backoff_max_s ({self.backoff_max_s}) must be >= backoff_base_s ({self.backoff_base_s}) "
                "(REIN_BACKOFF_MAX_S / REIN_BACKOFF_BASE_S)"
            )
        return self
