"""HTTP shell of the engine: ``create_app(settings) -> FastAPI``.

Routes translate JSON to :class:`EngineRunner` calls and back; every piece of state
(weights, batcher, decode task, metrics registry) is created in the lifespan and
reached through ``request.state``. Errors are mapped to HTTP in one place
(:func:`_install_error_handlers`).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Histogram
from pydantic import ValidationError

from services.engine.batcher import AdmissionError, Batcher, StepReport, Weights, limits
from services.engine.batcher import Request as EngineRequest
from services.engine.runner import EngineRunner, EngineUnavailableError, WeightUpdateError
from services.engine.sampling import SamplingParams
from services.engine.schemas import (
    AbortBody,
    AbortManyBody,
    GenerateBody,
    StageWeightsBody,
    UpdateWeightsBody,
    generate_response,
)
from services.engine.settings import EngineSettings
from shared import log, metrics
from shared.http_server import APP_OPTIONS, BodyLimit, DirectRoute
from shared.membership import Members, Registration
from shared.model import ModelFamily, load_family
from shared.names import RedisKeys
from shared.policy import resolve_device
from shared.state import connect
from shared.tokenizer import TOKENIZER


class EngineMetrics:
    """The engine's Prometheus series, on a registry owned by one app instance."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = metrics.counter(registry, "engine/requests", "Finished generate requests",
                                        ("finish_reason",))
        self.tokens = metrics.counter(registry, "engine/generated_tokens", "Tokens sampled by the engine")
        self.steps = metrics.counter(registry, "engine/decode_steps", "Batched decode steps run")
        self.batch_size = Histogram(
            metrics.prom_name("engine/batch_size"), "Requests decoded together in one step",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512), registry=registry,
        )
        self.active = metrics.gauge(registry, "engine/active_requests", "Requests currently decoding")
        self.weight_info = metrics.gauge(registry, "engine/weight_info",
                                         "1 for the weight version being served", ("weight_version", "digest"))
        self.weight_updates = metrics.counter(registry, "engine/weight_updates", "Weight update calls",
                                              ("result",))

    def on_step(self, report: StepReport) -> None:
        self.steps.inc()
        self.batch_size.observe(report.batch_size)

    def on_finish(self, req: EngineRequest) -> None:
        self.requests.labels(finish_reason=req.finish_type or "unknown").inc()
        self.tokens.inc(len(req.output_ids))

    def set_weights(self, weights: Weights) -> None:
        self.weight_info.clear()
        self.weight_info.labels(weight_version=weights.version, digest=weights.digest).set(1)


def initial_weights(settings: EngineSettings, family: ModelFamily, device: torch.device) -> Weights:
    """The checkpoint at ``model_path`` (read by the family), or the family's fresh model.

    Fresh: the tiny policy initialised from ``seed``; an HF model's pretrained weights.
    """
    path = settings.resolved_model_path()
    if path is not None:
        ckpt = family.load(path, device)
        vocab = limits(ckpt.model)[0]
        if vocab != family.tokenizer.vocab_size and family.kind == "tiny":
            raise RuntimeError(f"checkpoint {path} has vocab_size {vocab}, tokenizer has {family.tokenizer.vocab_size}")
        return Weights(model=ckpt.model, version=ckpt.version, digest=ckpt.digest, step=ckpt.step,
                       model_path=str(path))
    model = family.new_model(settings.seed, device).eval()
    return Weights(model=model, version=settings.initial_version, digest=family.digest(model), step=0,
                   model_path=None)


def _token_text(family: ModelFamily, ids: list[int], skip_special: bool) -> str:
    """Text of ``ids``: the tiny tokenizer keeps its ``skip_special`` switch, others skip specials."""
    if family.kind == "tiny":
        return TOKENIZER.decode(ids, skip_special=skip_special)
    return family.tokenizer.decode(ids)


def _finish_reason(req: EngineRequest) -> dict[str, Any]:
    if req.finish_type == "stop":
        return {"type": "stop", "matched": req.matched_stop}
    if req.finish_type == "length":
        return {"type": "length", "length": len(req.output_ids)}
    return {"type": "abort", "message": "request aborted"}


async def _refused(_: Request, exc: Exception) -> JSONResponse:
    """A request the engine cannot take: 400 (admission), 503 (not serving yet), 422 (a malformed body read by
    :class:`DirectRoute`, in FastAPI's own shape)."""
    if isinstance(exc, ValidationError):
        fields = [{"loc": ["body", *err["loc"]], "msg": err["msg"], "type": err["type"]} for err in exc.errors()]
        return JSONResponse({"detail": fields}, status_code=422)
    return JSONResponse({"detail": str(exc)}, status_code=503 if isinstance(exc, EngineUnavailableError) else 400)


def _install_error_handlers(app: FastAPI) -> None:
    async def weight_update(req: Request, exc: Exception) -> JSONResponse:
        req.state.metrics.weight_updates.labels(result="refused").inc()
        return JSONResponse({"success": False, "message": str(exc), "num_paused_requests": 0}, status_code=400)

    app.add_exception_handler(AdmissionError, _refused)
    app.add_exception_handler(EngineUnavailableError, _refused)
    app.add_exception_handler(WeightUpdateError, weight_update)


async def _register(settings: EngineSettings) -> Registration:
    """Register this engine in Redis (it serves already: the lifespan registers last)."""
    client = await asyncio.to_thread(connect, settings.redis)
    registration = Registration(Members(client, RedisKeys(settings.redis.key_prefix), "engine"), settings)
    try:
        await registration.start()
    except BaseException:
        client.close()
        raise
    return registration


def create_app(settings: EngineSettings) -> FastAPI:
    logger = log.get("engine")

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[dict[str, Any]]:
        torch.set_num_threads(settings.torch_threads)
        device = resolve_device(settings.device)
        family = load_family(settings.model)
        weights = initial_weights(settings, family, device)
        engine_metrics = EngineMetrics(CollectorRegistry(auto_describe=True))
        engine_metrics.set_weights(weights)
        batcher = Batcher(weights, end_id=family.tokenizer.stop_ids, pad_id=family.tokenizer.pad_id,
                          max_batch_size=settings.max_batch_size, seed=settings.seed, device=device,
                          kv_budget_tokens=settings.kv_budget_tokens, prefill_padding=settings.prefill_padding,
                          decode=family.tokenizer.decode)
        runner = EngineRunner(
            batcher, weights_dir=settings.weights_dir, device=device, vocab_size=weights.vocab_size,
            loader=family.load,
            step_delay_s=settings.step_delay_s, on_step=engine_metrics.on_step,
            on_finish=engine_metrics.on_finish, log=logger,
        )
        runner.start()
        logger.info("engine ready", weight_version=weights.version, digest=weights.digest,
                    model_path=weights.model_path, device=str(device),
                    params=sum(p.numel() for p in weights.model.parameters()))
        registration = await _register(settings) if settings.advertise_url else None
        try:
            yield {"runner": runner, "metrics": engine_metrics, "settings": settings, "family": family}
        finally:
            if registration is not None:
                await registration.stop()
                registration.members.client.close()
            await runner.stop()

    app = FastAPI(title="rein engine", lifespan=lifespan, **APP_OPTIONS)
    _install_error_handlers(app)

    @app.post("/generate")
    async def generate(body: GenerateBody, request: Request) -> dict[str, Any]:
        """Also registered for the schema and 405s; :class:`DirectRoute` answers the POSTs (below)."""
        return await _generate(body, request)

    async def generate_direct(request: Request) -> Response:
        body = GenerateBody.model_validate_json(await request.body())
        return Response(json.dumps(await _generate(body, request)), media_type="application/json")

    async def _generate(body: GenerateBody, request: Request) -> dict[str, Any]:
        if body.stream:
            raise AdmissionError("stream=true is not supported by this engine")
        runner: EngineRunner = request.state.runner
        sp = body.sampling_params
        params = SamplingParams(
            max_new_tokens=sp.max_new_tokens, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k,
            stop_token_ids=tuple(sp.stop_token_ids or ()), ignore_eos=sp.ignore_eos,
            stop=(sp.stop,) if isinstance(sp.stop, str) else tuple(sp.stop or ()),
        )
        rid = body.rid if body.rid is not None else uuid.uuid4().hex
        req = await runner.generate(rid, body.input_ids, params)
        family: ModelFamily = request.state.family
        logprobs = None
        if body.return_logprob:
            logprobs = [
                [lp, tok, _token_text(family, [tok], False) if body.return_text_in_logprobs else None]
                for lp, tok in zip(req.logprobs, req.output_ids, strict=True)
            ]
        return generate_response(
            rid=rid,
            text=_token_text(family, req.output_ids, sp.skip_special_tokens),
            output_ids=list(req.output_ids),
            finish_reason=_finish_reason(req),
            prompt_tokens=len(req.input_ids),
            weight_version=req.weight_version,
            token_versions=list(req.versions),
            logprobs=logprobs,
        )

    @app.post("/abort_request")
    async def abort_request(body: AbortBody, request: Request) -> dict[str, Any]:
        runner: EngineRunner = request.state.runner
        aborted = runner.abort(body.rid or None, body.abort_all)
        # rein's extra: a rid that had already finished here (a late abort), so a pausing proxy
        # knows it is not running without waiting for its /generate answer to be processed
        finished = [body.rid] if body.rid and not aborted and runner.finished(body.rid) else []
        return {"success": bool(aborted), "aborted": aborted, "finished": finished}

    @app.post("/abort_requests")
    async def abort_requests(body: AbortManyBody, request: Request) -> dict[str, Any]:
        """rein's extension: ``/abort_request``'s exact-rid abort for many rids in one call, answered
        as it is (``aborted`` now, ``finished`` already; any other rid is unknown here). A pausing
        proxy stops all its requests on this engine with one round trip instead of one per request."""
        runner: EngineRunner = request.state.runner
        aborted, finished = runner.abort_rids(body.rids)
        return {"success": bool(aborted), "aborted": aborted, "finished": finished}

    @app.post("/stage_weights")
    async def stage_weights(body: StageWeightsBody, request: Request) -> JSONResponse:
        """rein's extension: read and verify ``model_path`` now, while serving, so that the
        ``/update_weights_from_disk`` naming it (unchanged) only swaps it in. A broadcaster calls
        it before pausing the proxies; SGLang has no such route (404), and its update reads the file."""
        if not settings.stage_weights:
            return JSONResponse({"detail": "Not Found"}, status_code=404)  # as an engine without the route
        runner: EngineRunner = request.state.runner
        try:
            loaded = await runner.stage_weights(body.model_path)
        except WeightUpdateError as exc:
            return JSONResponse({"success": False, "message": str(exc)}, status_code=400)
        return JSONResponse({"success": True, "weight_version": loaded.version, "digest": loaded.digest})

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateWeightsBody, request: Request) -> dict[str, Any]:
        runner: EngineRunner = request.state.runner
        result = await runner.update_weights(body.model_path, body.weight_version, body.abort_all_requests)
        engine_metrics: EngineMetrics = request.state.metrics
        engine_metrics.set_weights(runner.batcher.weights)
        engine_metrics.weight_updates.labels(result="applied").inc()
        return {
            "success": True,
            "message": f"Loaded {result.model_path}. Weight version updated to {result.version}.",
            "num_paused_requests": 0,
            # rein's extras: what is served now, the requests abort_all_requests ended, and whether
            # the checkpoint had been staged (read ahead)
            "weight_version": result.version,
            "digest": result.digest,
            "aborted": result.aborted,
            "staged": result.staged,
        }

    @app.get("/get_model_info")
    async def get_model_info(request: Request) -> dict[str, Any]:
        runner: EngineRunner = request.state.runner
        weights = runner.batcher.weights
        return {
            "model_path": weights.model_path,
            "tokenizer_path": None,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": weights.version,
            # rein's extras
            "digest": weights.digest,
            "step": weights.step,
            "vocab_size": weights.vocab_size,
            "active_requests": len(runner.batcher.active_rids()),
            "active_rids": runner.batcher.active_rids(),
        }

    @app.get("/get_weight_version")
    async def get_weight_version(request: Request) -> dict[str, Any]:
        runner: EngineRunner = request.state.runner
        return {"weight_version": runner.batcher.weights.version}

    @app.get("/get_server_info")
    async def get_server_info(request: Request) -> dict[str, Any]:
        """SGLang's server args and scheduler info, the fields this engine has."""
        runner: EngineRunner = request.state.runner
        weights = runner.batcher.weights
        context = weights.context
        return {
            "model_path": weights.model_path,
            "tokenizer_path": None,
            "context_length": context,
            "max_req_input_len": context,
            "max_running_requests": settings.max_batch_size,
            "random_seed": settings.seed,
            "device": settings.device,
            "weight_version": weights.version,
            "status": "ready",
        }

    @app.get("/debug/active")
    async def debug_active(request: Request) -> dict[str, Any]:
        """Active requests and their progress: lets tests wait until a generation is mid-flight."""
        runner: EngineRunner = request.state.runner
        return {
            "weight_version": runner.batcher.weights.version,
            "requests": [
                {"rid": rid, "prompt_tokens": p, "completion_tokens": c} for rid, p, c in runner.batcher.progress()
            ],
        }

    @app.get("/health")
    async def health(request: Request) -> Response:
        runner: EngineRunner = request.state.runner
        if not runner.healthy:
            return JSONResponse({"status": "error", "detail": repr(runner.error)}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.post("/flush_cache")
    async def flush_cache() -> dict[str, Any]:
        return {"success": True}

    @app.get("/metrics")
    async def metrics_endpoint(request: Request) -> Response:
        engine_metrics: EngineMetrics = request.state.metrics
        runner: EngineRunner = request.state.runner
        engine_metrics.active.set(len(runner.batcher.active_rids()))
        body, content_type = metrics.render(engine_metrics.registry)
        return Response(body, media_type=content_type)

    # the hot route past FastAPI's per-route layers (its request parsing and response encoding cost the
    # engine more CPU per call than its own work on the tiny policy; docs/benchmarks.md)
    app.add_middleware(DirectRoute, path="/generate", endpoint=generate_direct,
                       errors=(AdmissionError, EngineUnavailableError, ValidationError), on_error=_refused)
    app.add_middleware(BodyLimit, max_bytes=settings.max_request_bytes)
    return app
