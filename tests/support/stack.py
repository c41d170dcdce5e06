"""The one starter of real engine and proxy processes for integration tests.

``engine_process`` runs ``python -m services.engine`` on a free port with its own weights dir;
``proxy_process`` runs ``python -m services.proxy`` in front of given engines, publishing to
given topics of the session's broker; ``engine_and_proxy`` nests the two. Each is a context
manager that returns once ``/health`` answers 200 and stops its process (by PID, bounded) on
exit. Test-specific settings go in ``extra_env`` as ``REIN_*`` variables.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from ops.local.credentials import Credentials
from ops.local.ports import free_port
from shared import checkpoint
from shared.names import Topics
from shared.policy import PolicyConfig, init_policy
from shared.tokenizer import TOKENIZER
from tests.support.procs import Proc, start_service

CFG = PolicyConfig(vocab_size=TOKENIZER.vocab_size)
"""The tiny policy every test checkpoint uses (the engine's default architecture)."""
START_TIMEOUT_S = 90.0


@dataclass
class Engine:
    """A running engine process and the weights dir it may load from."""

    url: str
    weights_dir: Path
    proc: Proc

    def checkpoint(self, version: str, seed: int = 1, where: Path | None = None) -> tuple[Path, str]:
        """Write a checkpoint labelled ``version`` (into ``where``, else the weights dir): (path, digest)."""
        path = ((where or self.weights_dir) / f"{version}-{uuid.uuid4().hex[:6]}.pt").resolve()
        digest = checkpoint.save(path, init_policy(CFG, seed), CFG, version=version, step=seed)
        return path, digest

    def load(self, version: str, seed: int = 1, path: Path | None = None) -> None:
        """Make the engine serve ``version`` (from ``path``, else a new checkpoint), engine idle or not."""
        path = path or self.checkpoint(version, seed)[0]
        r = httpx.post(
            f"{self.url}/update_weights_from_disk",
            json={"model_path": str(path), "weight_version": version},
            timeout=30,
        )
        assert r.status_code == 200, r.text

    def model_info(self) -> dict[str, Any]:
        data: dict[str, Any] = httpx.get(f"{self.url}/get_model_info", timeout=10).json()
        return data

    def requests_total(self) -> float:
        """Finished /generate requests (the engine's own counter)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return sum(
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("rein_engine_requests_total")
        )

    def active(self) -> list[dict[str, Any]]:
        requests: list[dict[str, Any]] = httpx.get(f"{self.url}/debug/active", timeout=10).json()["requests"]
        return requests


@dataclass
class ProxyProcess:
    """A running proxy process: its URL, credentials and topics."""

    url: str
    credentials: Credentials
    topics: Topics
    proc: Proc

    @property
    def admin_token(self) -> str:
        return self.credentials.admin_token

    @property
    def runner_token(self) -> str:
        return self.credentials.runner_token

    def healthy(self) -> bool:
        return httpx.get(f"{self.url}/health", timeout=10).status_code == 200


@contextmanager
def engine_process(
    weights_dir: Path,
    log_dir: Path,
    *,
    step_delay_s: float = 0.0,
    log_level: str = "warning",
    extra_env: Mapping[str, str] | None = None,
    advertise: bool = False,
) -> Iterator[Engine]:
    """An engine on a free port; ``step_delay_s`` slows decoding so a test can act mid-generation;
    ``advertise``: it registers its URL in Redis (``extra_env`` says which Redis)."""
    weights_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        "REIN_PORT": str(port),
        "REIN_WEIGHTS_DIR": str(weights_dir),
        "REIN_STEP_DELAY_S": str(step_delay_s),
        "REIN_TORCH_THREADS": "1",
        "REIN_LOG_LEVEL": log_level,
        **({"REIN_ADVERTISE_URL": url} if advertise else {}),
        **(extra_env or {}),
    }
    proc = start_service("services.engine", env, f"{url}/health", timeout_s=START_TIMEOUT_S, log_dir=log_dir)
    try:
        yield Engine(url=url, weights_dir=weights_dir, proc=proc)
    finally:
        proc.stop()


@contextmanager
def temp_engine(tmp_path_factory: pytest.TempPathFactory, **kw: Any) -> Iterator[Engine]:
    """:func:`engine_process` with its weights and logs in fresh directories of the pytest run (a fixture's
    or a test's own engine); ``kw`` as there."""
    with engine_process(tmp_path_factory.mktemp("weights"), tmp_path_factory.mktemp("logs"), **kw) as engine:
        yield engine


@contextmanager
def proxy_process(
    engine_urls: list[str],
    kafka_bootstrap: str,
    topics: Topics,
    log_dir: Path,
    *,
    admin_token: str,
    log_level: str = "warning",
    extra_env: Mapping[str, str] | None = None,
) -> Iterator[ProxyProcess]:
    """A proxy on a free port in front of ``engine_urls``, publishing to ``topics.chunks`` / ``.events``; its
    runner token and session-key secret are fresh (``ProxyProcess.credentials``)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    credentials = replace(Credentials.new(), admin_token=admin_token)
    env = {
        "REIN_PORT": str(port),
        "REIN_ENGINE_URLS": json.dumps(engine_urls),
        **credentials.proxy_env(),
        "REIN_KAFKA__BOOTSTRAP_SERVERS": kafka_bootstrap,
        "REIN_TOPICS__CHUNKS": topics.chunks,
        "REIN_TOPICS__EVENTS": topics.events,
        "REIN_LOG_LEVEL": log_level,
        **(extra_env or {}),
    }
    proc = start_service("services.proxy", env, f"{url}/health", timeout_s=START_TIMEOUT_S, log_dir=log_dir)
    try:
        yield ProxyProcess(url=url, credentials=credentials, topics=topics, proc=proc)
    finally:
        proc.stop()


@contextmanager
def engine_and_proxy(
    kafka_bootstrap: str,
    topics: Topics,
    weights_dir: Path,
    log_dir: Path,
    *,
    admin_token: str,
    step_delay_s: float = 0.0,
    engine_env: Mapping[str, str] | None = None,
    proxy_env: Mapping[str, str] | None = None,
) -> Iterator[tuple[Engine, ProxyProcess]]:
    """One engine and one proxy in front of it; the proxy stops first."""
    with (
        engine_process(weights_dir, log_dir, step_delay_s=step_delay_s, extra_env=engine_env) as engine,
        proxy_process(
            [engine.url], kafka_bootstrap, topics, log_dir, admin_token=admin_token, extra_env=proxy_env
        ) as proxy,
    ):
        yield engine, proxy
