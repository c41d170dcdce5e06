"""A black-box agent per episode: the rollout runner runs a command (a CLI agent with its own harness)
that is given only a base URL and an API key, and grades what it prints.

For each episode the runner opens the session on the proxy (``POST /v1/sessions``: the key carries the
session, group, prompt and attempt), then runs ``REIN_AGENT_COMMAND`` with

- ``OPENAI_BASE_URL`` / ``OPENAI_API_BASE`` (the proxy's ``/v1``) and ``OPENAI_API_KEY`` (the key),
  ``ANTHROPIC_BASE_URL`` (the proxy) and ``ANTHROPIC_API_KEY`` (the key), so OpenAI- and
  Anthropic-speaking agents both reach rein with nothing else configured;
- the task's prompt (its first messages' text) on stdin and in ``REIN_PROMPT``; ``{prompt}``,
  ``{base_url}`` and ``{api_key}`` in the command's arguments are replaced by the same values;
- the runner's environment without its ``REIN_*`` variables (no admin token reaches the agent).

The command's stdout is its final answer: the task's episode grades it as one assistant reply, and
the runner posts the reward by the session's key (the proxy recorded every call the agent made with
it; a session that made none still ends on record, with no chunk). Exit status 0 is graded (an
episode that wanted more turns ends ``truncated``); any other exit status is a ``failed`` episode
(``agent_exit_<status>``, counted toward the prompt's retries), and so is a command still running
after ``REIN_AGENT_TIMEOUT_S`` (``agent_timeout``: its process group is killed) or one that cannot be
started (``agent_not_started``, logged as an error). An agent whose session the proxy rejected gets
the proxy's 502 or 409 on its next call; the finish then reports the rejection, as for rein's own
agent loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Sequence
from typing import Any

from services.rollout.agent import Agent, EpisodeResult, SessionIds, error_name
from services.rollout.proxy_http import ProxyHttp, Timeout, Unreachable
from services.rollout.task import Episode, Message
from shared import log
from shared.lender import Lender
from shared.settings import child_env

STDERR_TAIL = 400
"""Characters of a failed command's stderr kept in the log."""


def prompt_text(messages: Sequence[Message]) -> str:
    """The text a black-box agent is given: the episode's first messages' contents, in order."""
    return "\n\n".join(m["content"] for m in messages if m.get("content"))


def command_line(command: Sequence[str], prompt: str, base_url: str, api_key: str) -> list[str]:
    """``command`` with ``{prompt}``, ``{base_url}`` and ``{api_key}`` replaced (plain replacement, so other
    braces in an argument, such as JSON, stay as they are)."""
    values = {"{prompt}": prompt, "{base_url}": base_url, "{api_key}": api_key}
    out = []
    for arg in command:
        for name, value in values.items():
            arg = arg.replace(name, value)
        out.append(arg)
    return out


def agent_env(proxy_url: str, api_key: str, prompt: str) -> dict[str, str]:
    """What the command is told: where rein is and which session it plays (see the module docstring)."""
    return child_env({
        "OPENAI_BASE_URL": f"{proxy_url}/v1", "OPENAI_API_BASE": f"{proxy_url}/v1", "OPENAI_API_KEY": api_key,
        "ANTHROPIC_BASE_URL": proxy_url, "ANTHROPIC_API_KEY": api_key, "REIN_PROMPT": prompt,
    })


class CommandAgent(Agent):
    """Plays episodes by running a black-box agent command through one proxy (the module says how)."""

    def __init__(self, clients: Lender[ProxyHttp], *, command: Sequence[str], timeout_s: float, proxy_url: str,
                 model: str, max_tokens: int, temperature: float, finish_attempts: int = 3) -> None:
        super().__init__(clients, proxy_url=proxy_url, model=model, max_tokens=max_tokens, temperature=temperature,
                         finish_attempts=finish_attempts)
        if not command:
            raise ValueError("a command agent needs a command")
        self._command = list(command)
        self._timeout_s = timeout_s

    async def _play(
        self, http: ProxyHttp, episode: Episode, payload: dict[str, Any], ids: SessionIds
    ) -> EpisodeResult:
        logger = log.get(__name__).bind(session_id=ids.session_id, group_id=ids.group_id, prompt_id=ids.prompt_id)
        messages: list[Message] = episode.reset(payload)
        prompt = prompt_text(messages)
        opened = await self._open(http, ids)
        if isinstance(opened, EpisodeResult):  # nothing recorded: the runner publishes the session's end
            logger.warning("agent_session_not_opened", error=opened.error)
            return opened
        argv = command_line(self._command, prompt, f"{self._proxy_url}/v1", opened)
        try:
            code, stdout, stderr = await self._run(argv, prompt, agent_env(self._proxy_url, opened, prompt))
        except OSError as exc:  # not found, not executable: every episode will fail the same way
            logger.error("agent_command_not_started", command=argv[0], error=str(exc))
            code, stdout, stderr = -1, "", str(exc)
        if code != 0:
            error = {None: "agent_timeout", -1: "agent_not_started"}.get(code, f"agent_exit_{code}")
            logger.info("agent_command_failed", error=error, stderr=stderr[-STDERR_TAIL:])
            result = EpisodeResult(ids.session_id, "failed", turns=1, error=error, messages=messages)
            return await self._report(http, result, logger, finish_as=opened)
        answer = stdout.strip()
        messages.append({"role": "assistant", "content": answer})
        ended = episode.step(answer) is None
        result = EpisodeResult(ids.session_id, episode.status if ended else "truncated", reward=episode.reward(),
                               turns=1, messages=messages)
        return await self._report(http, result, logger, finish_as=opened)

    async def _open(self, http: ProxyHttp, ids: SessionIds) -> str | EpisodeResult:
        """The session's API key from ``POST /v1/sessions``, or the failed result when the proxy cannot give one."""
        body = {"session_id": ids.session_id, "group_id": ids.group_id, "prompt_id": ids.prompt_id,
                "attempt": ids.attempt}
        try:
            response = await http.post("/v1/sessions", body)
        except (Timeout, Unreachable):
            return EpisodeResult(ids.session_id, "failed", error="unreachable", unreachable=True)
        key = response.body.get("api_key") if isinstance(response.body, dict) else None
        if response.status != 200 or not isinstance(key, str):
            return EpisodeResult(ids.session_id, "failed", error=error_name(response.body) or f"http_{response.status}")
        return key

    async def _run(self, argv: list[str], prompt: str, env: dict[str, str]) -> tuple[int | None, str, str]:
        """Run the command to its end or the timeout: (exit status or None when killed, stdout, stderr)."""
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env=env, start_new_session=True,  # its own process group: a timeout kills the agent and its children
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(prompt.encode()), self._timeout_s)
        except TimeoutError:
            return None, "", ""
        finally:
            if proc.returncode is None:  # timed out, or the runner is cancelling the group
                with contextlib.suppress(ProcessLookupError):  # it exited already
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
        return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")

