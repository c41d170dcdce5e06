"""The decode loop's state machine: admit, step, finish, abort, swap weights.

Pure core, no HTTP and no asyncio: tests drive it step by step.

Lifecycle of a request::

    admit ──▶ active ──step()*──▶ finished: stop   (sampled a stop token; it is in output_ids)
                 │                          length (token budget spent or context window full)
                 └──abort()───────▶ finished: abort (keeps the tokens generated so far)

A finished request never changes again: a late abort finds nothing and reports it. The
batcher remembers the last ``FINISHED_RIDS`` finished rids, so a late abort can tell "it
already finished here" from "never seen" (a pausing proxy counts the first as stopped and
sends the second again: its ``/generate`` may not have arrived yet).

Threading: :meth:`Batcher.step` is meant to run in a worker thread while the event
loop admits, aborts and swaps weights. One lock guards the request table and the
current weights; the forward pass runs outside it, on a snapshot of (batch, weights)
taken at the start of the step. So

- a request admitted during a step joins at the next step;
- a request aborted during a step is finished at once with the tokens it had; the
  token computed for it in that step is discarded;
- weights swapped during a step are used from the next step. Each token is stamped
  with the version of the weights that produced it (``Request.versions``); the
  request's ``weight_version`` is the engine's version at the moment it finishes.

KV cache: the forward pass goes through a :class:`shared.model.decoding.Decoder`, which
keeps each running request's keys and values, so a step costs one position per request
(a request prefills once, when it starts running, and again after a weight swap, since
its cache was computed by other weights; requests starting together prefill together,
left-padded, as ``prefill_padding`` allows). Only the step thread touches the decoder;
rows of finished or aborted requests are freed at the start of the next step.

Admission to the running set is FIFO and bounded twice: ``max_batch_size`` requests and
``kv_budget_tokens`` cache positions, counted as the decoder lays them out (rows x the
longest row, each request reserved at ``min(prompt + max_new_tokens, context)``). A request
that does not fit yet waits in the queue, still active (abortable, listed); one that could
never fit is refused at admission.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from services.engine.sampling import SamplingParams, completes_stop, sample_next
from shared.model.decoding import MAX_PADDING, Decoder
from shared.policy import PolicyConfig

FINISHED_RIDS = 65536
"""Finished rids remembered for late aborts (a few MB at most)."""

FinishType = Literal["stop", "length", "abort"]


class AdmissionError(ValueError):
    """A request was refused before it started (maps to HTTP 400)."""


class DuplicateRidError(AdmissionError):
    """A request with the same rid is still active."""


@dataclass(frozen=True)
class Weights:
    """The policy being served and its identity."""

    model: nn.Module
    version: str
    digest: str
    step: int
    model_path: str | None

    @property
    def config(self) -> PolicyConfig:
        """The tiny policy's config (vocab and context; any family's :func:`limits` say the same)."""
        config = self.model.config
        assert isinstance(config, PolicyConfig), "not a tiny policy: use limits()"
        return config

    @property
    def vocab_size(self) -> int:
        return limits(self.model)[0]

    @property
    def context(self) -> int:
        return limits(self.model)[1]


def limits(model: nn.Module) -> tuple[int, int]:
    """``(vocab_size, context window)`` of a tiny policy or a Hugging Face causal LM."""
    config: Any = model.config
    if isinstance(config, PolicyConfig):
        return config.vocab_size, config.context
    return int(config.vocab_size), int(config.max_position_embeddings)


@dataclass(eq=False)
class Request:
    """One generation. Mutated only by the batcher, under its lock."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    """Log of the probability each token had under the request's sampling distribution (0.0 greedy)."""
    versions: list[str] = field(default_factory=list)
    """Weight version that produced each output token."""
    finish_type: FinishType | None = None
    matched_stop: int | str | None = None
    weight_version: str | None = None
    """Engine weight version when the request finished."""

    @property
    def done(self) -> bool:
        return self.finish_type is not None

    @property
    def length(self) -> int:
        return len(self.input_ids) + len(self.output_ids)


@dataclass(frozen=True)
class StepReport:
    """What one decode step did."""

    batch_size: int
    finished: list[Request]
    version: str | None


class Batcher:
    """Active requests plus the current weights; one :meth:`step` decodes one token for each."""

    def __init__(
        self,
        weights: Weights,
        *,
        end_id: int | Iterable[int],
        max_batch_size: int = 256,
        seed: int = 0,
        device: torch.device | str = "cpu",
        pad_id: int = 0,
        kv_budget_tokens: int | None = None,
        kv_cache: bool = True,
        prefill_padding: float = MAX_PADDING,
        decode: Callable[[Sequence[int]], str] | None = None,
    ) -> None:
        """``prefill_padding`` is the decoder's ``max_padding`` (:func:`shared.model.decoding.prefill_groups`);
        ``decode`` (the model's tokenizer) turns ids into text for stop strings (requests with ``stop`` are
        refused without it)."""
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if kv_budget_tokens is not None and kv_budget_tokens < 1:
            raise ValueError(f"kv_budget_tokens must be >= 1, got {kv_budget_tokens}")
        self._kv_budget = kv_budget_tokens
        self._kv_cache = kv_cache
        self._prefill_padding = prefill_padding
        self._weights = weights
        self._end_ids = frozenset([end_id] if isinstance(end_id, int) else end_id)
        self._decode = decode
        self._pad_id = pad_id
        self._max_batch = max_batch_size
        self._device = torch.device(device)
        self._generator = torch.Generator(device="cpu")
        self._generator.manual_seed(seed)
        self._active: dict[str, Request] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()
        """The last ``FINISHED_RIDS`` finished rids, oldest first."""
        self._running: list[Request] = []
        """Requests admitted to the batch (their caches reserved), oldest first; a subset of _active."""
        self._decoder: Decoder | None = None
        self._lock = threading.Lock()

    # ---- read-only views -------------------------------------------------------------
    @property
    def weights(self) -> Weights:
        return self._weights

    def active_rids(self) -> list[str]:
        with self._lock:
            return list(self._active)

    def progress(self) -> list[tuple[str, int, int]]:
        """``(rid, prompt_tokens, completion_tokens)`` of each active request, oldest first."""
        with self._lock:
            return [(r.rid, len(r.input_ids), len(r.output_ids)) for r in self._active.values()]

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._active)

    def kv_tokens(self) -> int:
        """Cache positions the decoder holds now (freed rows included until the next step)."""
        decoder = self._decoder
        return decoder.tokens if decoder is not None else 0

    # ---- transitions -----------------------------------------------------------------
    def admit(self, rid: str, input_ids: Sequence[int], params: SamplingParams) -> Request:
        """Register a request; it is decoded from the next step on.

        Returns the request, which may already be finished (``length``) when its budget is
        zero or the prompt fills the context window. Raises AdmissionError for a duplicate
        active rid, an empty or too long prompt, or token ids outside the vocabulary.
        """
        ids = [int(t) for t in input_ids]
        with self._lock:
            vocab_size, context = self._weights.vocab_size, self._weights.context
            if not ids:
                raise AdmissionError("input_ids is empty")
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise AdmissionError(
                    f"input_ids contains ids outside the vocabulary [0, {vocab_size}): {bad[:5]}"
                )
            if len(ids) > context:
                raise AdmissionError(
                    f"input of {len(ids)} tokens is longer than the context window of {context}"
                )
            need = min(len(ids) + max(params.max_new_tokens, 0), context)
            if self._kv_budget is not None and need > self._kv_budget:
                raise AdmissionError(
                    f"request needs {need} tokens of KV cache (prompt + max_new_tokens); "
                    f"the engine's budget is {self._kv_budget}"
                )
            if rid in self._active:
                raise DuplicateRidError(f"request id {rid!r} is already active")
            if params.stop and (self._decode is None or not all(params.stop)):
                raise AdmissionError("stop strings need a tokenizer to decode with, and must not be empty")
            stops = set(params.stop_token_ids)
            if not params.ignore_eos:
                stops |= self._end_ids
            req = Request(rid=rid, input_ids=ids, params=params, stop_ids=frozenset(stops))
            if params.max_new_tokens <= 0 or len(ids) >= context:
                self._finish(req, "length")
            else:
                self._active[rid] = req
            return req

    def abort(self, rid: str | None = None, abort_all: bool = False) -> list[Request]:
        """Finish the active request with exactly this rid (or all of them) as ``abort``."""
        with self._lock:
            if abort_all:
                targets = list(self._active.values())
            elif rid is not None and rid in self._active:
                targets = [self._active[rid]]
            else:
                targets = []
            for req in targets:
                self._finish(req, "abort")
            return targets

    def abort_rids(self, rids: Iterable[str]) -> tuple[list[Request], list[str]]:
        """Finish every active request among ``rids`` as ``abort``, in one hold of the lock: the
        requests aborted now, and the rids that had already finished here (the rest are unknown)."""
        with self._lock:
            aborted: list[Request] = []
            finished: list[str] = []
            for rid in dict.fromkeys(rids):
                req = self._active.get(rid)
                if req is not None:
                    self._finish(req, "abort")
                    aborted.append(req)
                elif rid in self._finished:
                    finished.append(rid)
            return aborted, finished

    def finished(self, rid: str) -> bool:
        """True when a request with this rid finished here recently and none with it is active."""
        with self._lock:
            return rid in self._finished and rid not in self._active

    def abort_request(self, req: Request) -> bool:
        """Abort this very request object if it is still active (not a later one reusing its rid)."""
        with self._lock:
            if self._active.get(req.rid) is not req:
                return False
            self._finish(req, "abort")
            return True

    def swap_weights(self, weights: Weights) -> Weights:
        """Serve ``weights`` from the next step on; returns the previous weights."""
        with self._lock:
            old, self._weights = self._weights, weights
            return old

    def step(self) -> StepReport:
        """Decode one token for up to ``max_batch_size`` active requests (oldest first)."""
        finished: list[Request] = []
        with self._lock:
            weights = self._weights
            context = weights.context
            for req in list(self._active.values()):
                if req.length >= context:
                    self._finish(req, "length")
                    finished.append(req)
            batch = self._fill_batch(context)
            prefixes = [req.input_ids + req.output_ids for req in batch]
            temps = [req.params.temperature for req in batch]
            top_ks = [req.params.top_k for req in batch]
            top_ps = [req.params.top_p for req in batch]
        decoder = self._decoder
        if decoder is None or decoder.model is not weights.model:  # new weights: every row prefills again
            decoder = self._decoder = Decoder(weights.model, pad_id=self._pad_id, use_cache=self._kv_cache,
                                              max_padding=self._prefill_padding)
        if not batch:
            decoder.clear()
            return StepReport(batch_size=0, finished=finished, version=weights.version)

        logits = decoder.last_logits(list(zip(batch, prefixes, strict=True)))
        tokens, logprobs = sample_next(
            logits,
            temperature=torch.tensor(temps, dtype=torch.float32),
            top_k=torch.tensor(top_ks, dtype=torch.long),
            top_p=torch.tensor(top_ps, dtype=torch.float32),
            generator=self._generator,
        )

        with self._lock:
            for req, tok, lp in zip(batch, tokens.tolist(), logprobs.tolist(), strict=True):
                if req.done:  # aborted while the forward pass ran
                    continue
                req.output_ids.append(tok)
                req.logprobs.append(lp)
                req.versions.append(weights.version)
                matched = completes_stop(req.input_ids + req.output_ids, 1, req.params.stop, self._decode) \
                    if req.params.stop and self._decode is not None else None
                if tok in req.stop_ids:
                    req.matched_stop = tok
                    self._finish(req, "stop")
                elif matched is not None:
                    req.matched_stop = matched
                    self._finish(req, "stop")
                elif len(req.output_ids) >= req.params.max_new_tokens or req.length >= context:
                    self._finish(req, "length")
                else:
                    continue
                finished.append(req)
        return StepReport(batch_size=len(batch), finished=finished, version=weights.version)

    # ---- internals -------------------------------------------------------------------
    def _finish(self, req: Request, kind: FinishType) -> None:
        """Caller holds the lock."""
        req.finish_type = kind
        req.weight_version = self._weights.version
        if self._active.get(req.rid) is req:
            del self._active[req.rid]
        self._finished[req.rid] = None
        self._finished.move_to_end(req.rid)
        if len(self._finished) > FINISHED_RIDS:
            self._finished.popitem(last=False)

    def _fill_batch(self, context: int) -> list[Request]:
        """Caller holds the lock. Drop finished requests from the running set, then admit
        waiting ones oldest first while the batch size and the KV budget allow (the first
        that does not fit blocks those behind it, so none is starved)."""
        running = [req for req in self._running if not req.done]
        taken = {id(req) for req in running}
        longest = max((self._reserve(req, context) for req in running), default=0)
        for req in self._active.values():
            if id(req) in taken:
                continue
            if len(running) >= self._max_batch:
                break
            need = max(longest, self._reserve(req, context))
            if self._kv_budget is not None and (len(running) + 1) * need > self._kv_budget:
                break
            running.append(req)
            longest = need
        self._running = running
        return list(running)

    @staticmethod
    def _reserve(req: Request, context: int) -> int:
        """Most cache positions this request can hold: its prompt plus its budget, within the context."""
        return min(len(req.input_ids) + req.params.max_new_tokens, context)
