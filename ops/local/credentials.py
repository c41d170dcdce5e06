"""The secrets of one deployment, made fresh per run, and which service gets which (docs/security.md).

The operator's admin token goes to the proxies and the broadcaster, the runner token to the proxies and
the rollout runner, the session-key secret and the run id to the proxies only. An agent gets none of
them: the runner opens its session and hands it that session's key.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Credentials:
    admin_token: str
    runner_token: str
    session_key_secret: str
    run_id: str

    @classmethod
    def new(cls, run_id: str = "") -> Credentials:
        """Fresh random secrets; ``run_id`` defaults to the start time plus a random suffix."""
        return cls(secrets.token_hex(16), secrets.token_hex(16), secrets.token_hex(32),
                   run_id or f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}")

    def proxy_env(self) -> dict[str, str]:
        return {"REIN_ADMIN_TOKEN": self.admin_token, "REIN_RUNNER_TOKEN": self.runner_token,
                "REIN_SESSION_KEY_SECRET": self.session_key_secret, "REIN_RUN_ID": self.run_id}

    def runner_env(self) -> dict[str, str]:
        return {"REIN_RUNNER_TOKEN": self.runner_token}

    def broadcaster_env(self) -> dict[str, str]:
        return {"REIN_ADMIN_TOKEN": self.admin_token}
