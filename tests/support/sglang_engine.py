"""A scripted engine that speaks exactly SGLang's native HTTP API, and nothing rein adds.

Routes and field names follow sgl-project/sglang ``python/sglang/srt/entrypoints/http_server.py``
and ``managers/io_struct.py``:

- ``GET /get_model_info``: ``{model_path, tokenizer_path, is_generation,
  preferred_sampling_params, weight_version}`` (no context length, no digest);
- ``GET /get_server_info``: server args and scheduler info; ``context_length`` is null unless
  the server was launched with ``--context-length``, ``max_req_input_len`` is always there;
- ``POST /generate``: ``{text, output_ids, meta_info}``; ``meta_info`` carries ``id``,
  ``finish_reason`` (``{"type": "length", "length": n}`` / ``{"type": "abort", "message": ...}``),
  ``prompt_tokens``, ``completion_tokens``, ``weight_version`` (the server's label when the
  answer is built) and, with ``return_logprob``, ``output_token_logprobs`` as
  ``[logprob, token_id, text_or_null]`` triples; no per-token versions;
- ``POST /abort_request``: 200 with an empty body, whether or not the rid matched;
- ``POST /update_weights_from_disk``: waits for running requests to finish (unless
  ``abort_all_requests``), then ``{success, message, num_paused_requests}``; 400 with the same
  shape when loading fails.

Bodies are checked against SGLang's field names, so a client sending a field SGLang lacks
fails here as it would fail there. Each request decodes one token per ``token_delay_s`` so a
test can pause while a generation is in flight (``stall_after`` holds it there); output
tokens cycle through a few words of rein's tiny vocabulary (the proxy decodes them with it).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ops.local.ports import free_port
from shared.tokenizer import TOKENIZER
from tests.support.proxy import ServerThread

GENERATE_FIELDS = frozenset({
    "text", "input_ids", "input_embeds", "image_data", "sampling_params", "rid", "return_logprob",
    "logprob_start_len", "top_logprobs_num", "token_ids_logprob", "return_text_in_logprobs", "stream",
    "log_metrics", "return_hidden_states", "modalities", "session_params", "lora_path", "custom_logit_processor",
    "bootstrap_host", "bootstrap_port", "bootstrap_room", "data_parallel_rank", "no_logs",
})
"""Fields of SGLang's ``GenerateReqInput`` (a subset: the ones a client may plausibly send)."""
SAMPLING_FIELDS = frozenset({
    "max_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
    "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex", "ebnf",
    "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "custom_params", "stream_interval", "logit_bias", "sampling_seed",
})
"""Arguments of SGLang's ``SamplingParams``."""
ABORT_FIELDS = frozenset({"rid", "abort_all", "finished_reason", "abort_message"})
UPDATE_FIELDS = frozenset({
    "model_path", "load_format", "abort_all_requests", "weight_version", "is_async", "torch_empty_cache",
    "keep_pause", "recapture_cuda_graph", "token_step", "flush_cache",
})
"""Fields of SGLang's ``UpdateWeightFromDiskReqInput``."""

WORDS = TOKENIZER.encode("higher lower guess")


@dataclass
class _Running:
    rid: str
    output_ids: list[int] = field(default_factory=list)
    aborted: bool = False


@dataclass
class ScriptedSGLang:
    """State of the scripted server; :meth:`app` builds its FastAPI app."""

    max_req_input_len: int = 40
    """SGLang: min(context_len - 1, max_total_num_tokens - 1) - 5."""
    token_delay_s: float = 0.02
    stall_after: int | None = None
    """While set, each request stops decoding after this many tokens until it is aborted (or the
    attribute is cleared): holds a generation in flight for as long as a test needs."""
    keep_label: bool = False
    """True: ignore ``weight_version`` on updates (an engine that does not take the label)."""
    weight_version: str = "default"
    """SGLang's label before any update that names one."""
    model_path: str = "/models/base"
    script: list[list[int]] = field(default_factory=list)
    """Outputs of the next requests, in order (each taken whole, then the word cycle resumes): a script whose
    last id is one of the request's ``stop_token_ids`` finishes ``stop``, as SGLang's would."""
    generate_bodies: list[dict[str, Any]] = field(default_factory=list)
    aborts: list[dict[str, Any]] = field(default_factory=list)
    updates: list[dict[str, Any]] = field(default_factory=list)
    info_reads: list[str] = field(default_factory=list)
    running: dict[str, _Running] = field(default_factory=dict)

    @property
    def context_len(self) -> int:
        return self.max_req_input_len + 6

    def app(self) -> FastAPI:
        app = FastAPI()
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/get_model_info", self.get_model_info, methods=["GET"])
        app.add_api_route("/get_server_info", self.get_server_info, methods=["GET"])
        app.add_api_route("/generate", self.generate, methods=["POST"])
        app.add_api_route("/abort_request", self.abort_request, methods=["POST"])
        app.add_api_route("/update_weights_from_disk", self.update_weights_from_disk, methods=["POST"])
        return app

    async def health(self) -> Response:
        return Response(status_code=200)

    async def get_model_info(self) -> dict[str, Any]:
        self.info_reads.append("/get_model_info")
        return {"model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": self.weight_version}

    async def get_server_info(self) -> dict[str, Any]:
        self.info_reads.append("/get_server_info")
        return {
            "model_path": self.model_path, "tokenizer_path": self.model_path, "context_length": None,
            "tp_size": 1, "weight_version": self.weight_version, "skip_tokenizer_init": False,
            "status": "ready", "max_total_num_tokens": 4096, "max_req_input_len": self.max_req_input_len,
            "internal_states": [{"last_gen_throughput": 0.0}], "version": "0.5.6",
        }

    async def generate(self, request: Request) -> Any:
        body = await request.json()
        self.generate_bodies.append(body)
        sp = body.get("sampling_params") or {}
        unknown = sorted((set(body) - GENERATE_FIELDS) | (set(sp) - SAMPLING_FIELDS))
        if unknown:
            return _error(f"unexpected fields for SGLang: {unknown}")
        input_ids, max_new = list(body["input_ids"]), int(sp.get("max_new_tokens", 128))
        if len(input_ids) >= self.max_req_input_len:
            return _error(f"Input length ({len(input_ids)} tokens) exceeds the maximum allowed length "
                          f"({self.max_req_input_len} tokens)")
        if len(input_ids) + max_new >= self.context_len:
            return _error(f"Requested token count exceeds the model's maximum context length of {self.context_len}")
        rid = body.get("rid") or uuid.uuid4().hex
        req = self.running[rid] = _Running(rid)
        started = time.monotonic()
        scripted = self.script.pop(0)[:max_new] if self.script else None
        try:
            while len(req.output_ids) < (max_new if scripted is None else len(scripted)) and not req.aborted:
                await asyncio.sleep(self.token_delay_s)
                if self.stall_after is not None and len(req.output_ids) >= self.stall_after:
                    continue
                req.output_ids.append(WORDS[(len(input_ids) + len(req.output_ids)) % len(WORDS)] if scripted is None
                                      else scripted[len(req.output_ids)])
        finally:
            del self.running[rid]
        stopped = bool(req.output_ids) and req.output_ids[-1] in (sp.get("stop_token_ids") or ())
        finish: dict[str, Any] = (
            {"type": "abort", "message": "Abort in waiting queue"} if req.aborted
            else {"type": "stop", "matched": req.output_ids[-1]} if stopped
            else {"type": "length", "length": len(req.output_ids)}
        )
        meta: dict[str, Any] = {
            "id": rid, "finish_reason": finish, "prompt_tokens": len(input_ids), "weight_version": self.weight_version,
            "total_retractions": 0, "completion_tokens": len(req.output_ids), "cached_tokens": 0,
            "e2e_latency": time.monotonic() - started,
        }
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[-0.5 - 0.01 * i, tok, None] for i, tok in enumerate(req.output_ids)]
        text = TOKENIZER.decode(req.output_ids) if scripted is None else ""  # scripted ids need not be tiny words
        return {"text": text, "output_ids": req.output_ids, "meta_info": meta}

    async def abort_request(self, request: Request) -> Response:
        body = await request.json()
        self.aborts.append(body)
        if set(body) - ABORT_FIELDS:
            return _error(f"unexpected fields for SGLang: {sorted(set(body) - ABORT_FIELDS)}")
        for req in self.running.values():
            if body.get("abort_all") or req.rid == body.get("rid"):
                req.aborted = True
        return Response(status_code=200)

    async def update_weights_from_disk(self, request: Request) -> JSONResponse:
        body = await request.json()
        self.updates.append(body)
        unknown = sorted(set(body) - UPDATE_FIELDS)
        path = Path(str(body.get("model_path") or ""))
        if unknown or not path.exists():
            message = f"unexpected fields {unknown}" if unknown else f"Failed to get weights iterator: {path}"
            return JSONResponse({"success": False, "message": message, "num_paused_requests": 0}, status_code=400)
        if body.get("abort_all_requests"):
            for req in self.running.values():
                req.aborted = True
        deadline = time.monotonic() + 30
        while self.running and time.monotonic() < deadline:  # SGLang waits for running requests
            await asyncio.sleep(0.01)
        if self.running:
            return JSONResponse({"success": False, "message": "timed out waiting for running requests",
                                 "num_paused_requests": 0}, status_code=400)
        self.model_path = str(path)
        message = "Succeeded to update model weights."
        if body.get("weight_version") is not None and not self.keep_label:
            self.weight_version = str(body["weight_version"])
            message += f" Weight version updated to {self.weight_version}."
        return JSONResponse({"success": True, "message": message, "num_paused_requests": 0})


def _error(message: str) -> JSONResponse:
    """SGLang's ``_create_error_response``: 400 ``{"error": {"message": ...}}``."""
    return JSONResponse({"error": {"message": message}}, status_code=400)


ScriptedServers = Callable[..., tuple[ScriptedSGLang, str]]
"""``make(**fields) -> (engine, url)``: a :class:`ScriptedSGLang` served on a free port."""


@pytest.fixture
def sglang() -> Iterator[ScriptedServers]:
    """Scripted SGLang servers for one test, stopped after it (import the fixture where it is used)."""
    servers: list[ServerThread] = []

    def make(**kw: Any) -> tuple[ScriptedSGLang, str]:
        engine = ScriptedSGLang(**kw)
        server = ServerThread(engine.app(), free_port())
        server.start()
        servers.append(server)
        return engine, server.url

    try:
        yield make
    finally:
        for server in servers:
            server.stop()
