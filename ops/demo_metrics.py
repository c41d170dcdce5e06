"""What ``make demo`` reads from the services' ``/metrics`` while it runs: the proxy's rejections and
tool-call replies, the engine's load. Read over HTTP as Prometheus text, as any scraper would, through
one :func:`scrape`; a service that does not answer leaves the reading out rather than stopping the demo."""

from __future__ import annotations

import http.client
import re
import time
from dataclasses import dataclass, field
from typing import Any

from ops.status_parts import http_text, parse_rejections
from services.proxy.wires import WIRES

_TOOL_CALLS = re.compile(r'^rein_proxy_tool_call_replies_total\{outcome="(\w+)"\}\s+([0-9.eE+-]+)$', re.M)
_ANSWERS = re.compile(r'^rein_proxy_requests_total\{route="([^"]*)",status="200"\}\s+([0-9.eE+-]+)$', re.M)
_ENGINE_ACTIVE = re.compile(r"^rein_engine_active_requests\s+([0-9.eE+-]+)$", re.M)
_ENGINE_TOKENS = re.compile(r"^rein_engine_generated_tokens_total\s+([0-9.eE+-]+)$", re.M)


def scrape(url: str, timeout_s: float = 2.0) -> str | None:
    """``url``'s ``/metrics`` text, or None when it could not be read. Through ``rein status``'s plain
    ``urllib`` read: ``httpx.get`` built a client, and so an SSL context loading the system's CA store, on each
    call, which took the demo's own process 16 % of a core (py-spy) on a machine the pipeline needs whole."""
    try:
        return http_text(f"{url}/metrics", timeout_s)
    except (OSError, http.client.HTTPException):
        return None


def proxy_tool_calls(text: str) -> dict[str, Any]:
    """From the proxy's ``/metrics`` text: its chat answers (``replies``), those with tool-call markup it parsed
    into calls or found malformed, and the parsed share of the latter (None without markup)."""
    counts = {outcome: int(float(n)) for outcome, n in _TOOL_CALLS.findall(text)}
    calls, malformed = counts.get("calls", 0), counts.get("malformed", 0)
    replies = chat_replies(text)
    return {"replies": replies, "replies_with_calls": calls, "malformed": malformed,
            "well_formed_share": calls / (calls + malformed) if calls + malformed else None}


def chat_replies(text: str) -> int:
    """The proxy's 200 answers on its chat routes, those of every wire it serves, from its ``/metrics`` text."""
    return sum(int(float(n)) for route, n in _ANSWERS.findall(text) if route in WIRES)


@dataclass
class ToolCallSeries:
    """The proxy's tool-call counters read with each batch of trainer lines, so a tool task's run shows how
    the share of replies that are well-formed calls moves while it trains (summary and plot)."""

    samples: list[dict[str, Any]] = field(default_factory=list)

    def sample(self, lines: int, text: str) -> None:
        """The counters in the proxy's ``/metrics`` ``text``, read once ``lines`` trainer lines were shown."""
        counts = proxy_tool_calls(text)
        if counts["replies"]:  # kept only for a tool task
            self.samples.append({"lines": lines, "ts": round(time.time(), 1), **counts})

    def annotate(self, rows: list[dict[str, Any]]) -> None:
        """Put on the last line each sample saw the share of the replies since the previous sample that were
        parsed calls (``tool_call_share``) and malformed markup (``malformed_call_share``)."""
        before = {"replies": 0, "replies_with_calls": 0, "malformed": 0}
        for sample in self.samples:
            replies = sample["replies"] - before["replies"]
            if replies > 0 and 0 < sample["lines"] <= len(rows):
                row = rows[sample["lines"] - 1]
                row["tool_call_share"] = (sample["replies_with_calls"] - before["replies_with_calls"]) / replies
                row["malformed_call_share"] = (sample["malformed"] - before["malformed"]) / replies
            before = sample


def proxy_rejections(text: str) -> int:
    """Sessions the proxy rejected, every reason, from its ``/metrics`` text."""
    return int(sum(parse_rejections(text).values()))


@dataclass
class EngineUsage:
    """The engine's generation load, sampled from its ``/metrics`` while the demo runs."""

    samples: int = 0
    busy_samples: int = 0
    tokens: float = 0.0

    def sample(self, text: str) -> None:
        """One reading of the engine's ``/metrics`` ``text``."""
        active, tokens = _ENGINE_ACTIVE.search(text), _ENGINE_TOKENS.search(text)
        if active is None:
            return
        self.samples += 1
        self.busy_samples += float(active.group(1)) > 0
        if tokens is not None:
            self.tokens = float(tokens.group(1))

    @property
    def busy_fraction(self) -> float | None:
        return self.busy_samples / self.samples if self.samples else None
