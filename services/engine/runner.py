"""Async driver around :class:`Batcher`: one background task runs the decode loop.

The task sleeps until a request is admitted, then repeatedly runs ``Batcher.step`` in
a worker thread (``asyncio.to_thread``) so torch never blocks the event loop, and
resolves the futures of the requests each step finished. Admission, abort and weight
swaps run on the event loop; the batcher's lock makes them safe against a step in
flight. Weight loading also runs in a worker thread, one update at a time.

If the loop task dies, the runner records the error, fails every waiting request and
reports itself unhealthy (``/health`` answers 503) instead of hanging callers.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from services.engine.batcher import Batcher, Request, StepReport, Weights, limits
from services.engine.sampling import SamplingParams
from shared import checkpoint
from shared.model.base import Loaded, ModelError

Loader = Callable[[Path, torch.device], Loaded]
"""Reads and verifies a checkpoint: the model family's ``load`` (a file for tiny, a directory for HF)."""


def _load_tiny(path: Path, device: torch.device) -> Loaded:
    ckpt = checkpoint.load(path, device)
    return Loaded(model=ckpt.model, version=ckpt.version, step=ckpt.step, digest=ckpt.digest)


class EngineUnavailableError(RuntimeError):
    """The decode loop has stopped; the engine cannot serve requests."""


class WeightUpdateError(ValueError):
    """A weight update was refused (path outside weights_dir, missing or bad file)."""


@dataclass(frozen=True)
class UpdateResult:
    version: str
    digest: str
    model_path: str
    aborted: list[str]
    staged: bool
    """The checkpoint had been read ahead by ``/stage_weights``."""


@dataclass(frozen=True)
class _Staged:
    path: Path
    stamp: tuple[tuple[str, int, int], ...]
    loaded: Loaded


def _stamp(path: Path) -> tuple[tuple[str, int, int], ...]:
    """Name, size and mtime of the checkpoint's file (or of each file of its directory): a staged
    checkpoint is used only while these are unchanged."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return tuple((str(f), (st := f.stat()).st_size, st.st_mtime_ns) for f in files)


class EngineRunner:
    """Owns the batcher, the decode task and the waiting callers."""

    def __init__(
        self,
        batcher: Batcher,
        *,
        weights_dir: Path,
        device: torch.device,
        vocab_size: int,
        step_delay_s: float = 0.0,
        on_step: Callable[[StepReport], None] | None = None,
        on_finish: Callable[[Request], None] | None = None,
        log: structlog.stdlib.BoundLogger | None = None,
        loader: Loader | None = None,
    ) -> None:
        self.batcher = batcher
        self._loader = loader or _load_tiny
        self._weights_root = weights_dir.resolve()
        self._device = device
        self._vocab_size = vocab_size
        self._step_delay_s = step_delay_s
        self._on_step = on_step
        self._on_finish = on_finish
        self._log = log or structlog.get_logger()
        self._waiters: dict[Request, asyncio.Future[Request]] = {}
        self._wake = asyncio.Event()
        self._update_lock = asyncio.Lock()
        self._staged: _Staged | None = None
        self._task: asyncio.Task[None] | None = None
        self.error: BaseException | None = None

    # ---- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="engine-decode-loop")
        self._task.add_done_callback(self._on_task_done)

    async def stop(self) -> None:
        if self._task is not None and not self._task.done():  # a dead task's error is already in self.error
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._fail_waiters(EngineUnavailableError("engine is shutting down"))

    @property
    def healthy(self) -> bool:
        return self.error is None and self._task is not None and not self._task.done()

    def _on_task_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self.error = exc
            self._log.error("decode loop died", error=repr(exc), exc_info=exc)
            self._fail_waiters(EngineUnavailableError(f"decode loop died: {exc!r}"))

    def _fail_waiters(self, exc: BaseException) -> None:
        waiters, self._waiters = self._waiters, {}
        for fut in waiters.values():
            if not fut.done():
                fut.set_exception(exc)

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            report = await asyncio.to_thread(self.batcher.step)
            if self._on_step is not None and report.batch_size:
                self._on_step(report)
            self._resolve(report.finished)
            if not self.batcher.has_work():
                self._wake.clear()
            if self._step_delay_s > 0:
                await asyncio.sleep(self._step_delay_s)

    def _resolve(self, finished: Sequence[Request]) -> None:
        for req in finished:
            if self._on_finish is not None:
                self._on_finish(req)
            fut = self._waiters.pop(req, None)
            if fut is not None and not fut.done():
                fut.set_result(req)

    # ---- operations ------------------------------------------------------------------
    async def generate(self, rid: str, input_ids: Sequence[int], params: SamplingParams) -> Request:
        """Admit a request and wait until it finishes (stop, length or abort).

        If the caller is cancelled (client went away), the request is aborted so it
        stops taking batch slots.
        """
        if not self.healthy:
            raise EngineUnavailableError(f"decode loop is not running: {self.error!r}")
        req = self.batcher.admit(rid, input_ids, params)
        if req.done:
            self._resolve([req])
            return req
        fut: asyncio.Future[Request] = asyncio.get_running_loop().create_future()
        self._waiters[req] = fut
        self._wake.set()
        try:
            return await fut
        except asyncio.CancelledError:
            if self.batcher.abort_request(req):
                self._resolve([req])
                self._wake.set()
            raise

    def abort(self, rid: str | None, abort_all: bool) -> list[str]:
        """Abort matching active requests now; their callers get partial tokens."""
        aborted = self.batcher.abort(rid, abort_all)
        self._resolve(aborted)
        if aborted:
            self._wake.set()  # one more step frees their KV cache rows even if nothing else runs
        return [req.rid for req in aborted]

    def abort_rids(self, rids: Sequence[str]) -> tuple[list[str], list[str]]:
        """Abort every active request among ``rids`` now: the rids aborted, and those already finished."""
        aborted, finished = self.batcher.abort_rids(rids)
        self._resolve(aborted)
        if aborted:
            self._wake.set()
        return [req.rid for req in aborted], finished

    def finished(self, rid: str) -> bool:
        """True when ``rid`` already finished here (and is not running again)."""
        return self.batcher.finished(rid)

    def resolve_weights_path(self, model_path: str) -> Path:
        """Absolute, symlink-resolved path inside ``weights_dir``, else WeightUpdateError."""
        raw = Path(model_path)
        candidate = raw if raw.is_absolute() else self._weights_root / raw
        resolved = candidate.resolve()
        if not resolved.is_relative_to(self._weights_root):
            raise WeightUpdateError(f"model_path {model_path!r} is outside the weights dir {self._weights_root}")
        if not resolved.exists():
            raise WeightUpdateError(f"model_path {model_path!r} does not exist (resolved to {resolved})")
        return resolved

    async def stage_weights(self, model_path: str) -> Loaded:
        """Read and verify a checkpoint ahead of its update (rein's ``/stage_weights``), while the
        engine keeps serving: an update naming the same unchanged file then only swaps it in, so
        the proxies' pause waits for the swap, not for the read. One staged checkpoint at a time."""
        path = self.resolve_weights_path(model_path)
        stamp = _stamp(path)
        loaded = await self._load(path)
        self._staged = _Staged(path, stamp, loaded)
        return loaded

    async def _load(self, path: Path) -> Loaded:
        try:
            ckpt = await asyncio.to_thread(self._loader, path, self._device)
        except (checkpoint.CheckpointError, ModelError, OSError) as exc:
            raise WeightUpdateError(str(exc)) from exc
        vocab = limits(ckpt.model)[0]
        if vocab != self._vocab_size:
            raise WeightUpdateError(f"checkpoint vocab_size {vocab} != served vocab_size {self._vocab_size}")
        return ckpt

    async def update_weights(
        self, model_path: str, weight_version: str | None, abort_all_requests: bool
    ) -> UpdateResult:
        """Serve a checkpoint from the next decode step: the one staged for this path if its file
        did not change since, else read now off the event loop."""
        async with self._update_lock:
            path = self.resolve_weights_path(model_path)
            started = time.monotonic()
            staged, self._staged = self._staged, None
            if staged is not None and staged.path == path and staged.stamp == _stamp(path):
                ckpt = staged.loaded
            else:
                staged = None
                ckpt = await self._load(path)
            aborted = self.abort(None, abort_all=True) if abort_all_requests else []
            version = weight_version if weight_version is not None else ckpt.version
            new = Weights(model=ckpt.model, version=version, digest=ckpt.digest, step=ckpt.step,
                          model_path=str(path))
            old = self.batcher.swap_weights(new)
            self._log.info("weights updated", old_version=old.version, weight_version=version,
                           digest=ckpt.digest, model_path=str(path), aborted=len(aborted),
                           staged=staged is not None, load_s=round(time.monotonic() - started, 4))
            return UpdateResult(version=version, digest=ckpt.digest, model_path=str(path), aborted=aborted,
                                staged=staged is not None)
