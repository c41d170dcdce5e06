"""The real engine process over HTTP: batching, abort, weight updates, errors.

One engine subprocess per module, slowed with ``REIN_STEP_DELAY_S`` so a generation
is reliably still in flight when a test aborts it or swaps the weights.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from shared import checkpoint
from shared.policy import init_policy
from shared.tokenizer import TOKENIZER
from tests.support.stack import CFG, Engine, temp_engine

pytestmark = pytest.mark.integration

PROMPT = TOKENIZER.apply_chat_template([{"role": "user", "content": "guess"}], add_generation_prompt=True)
T = TypeVar("T")


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    with temp_engine(tmp_path_factory, step_delay_s=0.02, log_level="info") as engine:
        yield engine


def run(body: Callable[[], Awaitable[T]], timeout_s: float = 60) -> T:
    return asyncio.run(asyncio.wait_for(body(), timeout_s))


async def wait_generating(client: httpx.AsyncClient, rid: str, min_tokens: int = 1) -> None:
    """Poll /debug/active until ``rid`` has produced ``min_tokens``; bounded by the caller's timeout."""
    while True:
        active = {r["rid"]: r for r in (await client.get("/debug/active")).json()["requests"]}
        if rid in active and active[rid]["completion_tokens"] >= min_tokens:
            return
        await asyncio.sleep(0.01)


def slow_body(rid: str, max_new_tokens: int = 50) -> dict[str, Any]:
    return {
        "input_ids": PROMPT,
        "rid": rid,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True},
    }


def batch_stats(metrics_text: str) -> tuple[float, float]:
    total = re.search(r"^rein_engine_batch_size_sum (\S+)$", metrics_text, re.M)
    count = re.search(r"^rein_engine_batch_size_count (\S+)$", metrics_text, re.M)
    assert total and count, metrics_text
    return float(total.group(1)), float(count.group(1))


def test_concurrent_generates_are_batched(engine: Engine) -> None:
    async def body() -> None:
        async with httpx.AsyncClient(base_url=engine.url, timeout=30) as client:
            before = batch_stats((await client.get("/metrics")).text)
            rids = [f"conc-{uuid.uuid4().hex}" for _ in range(6)]
            responses = await asyncio.gather(
                *(client.post("/generate", json=slow_body(rid, max_new_tokens=8)) for rid in rids)
            )
            after = batch_stats((await client.get("/metrics")).text)
        for rid, r in zip(rids, responses, strict=True):
            assert r.status_code == 200, r.text
            meta = r.json()["meta_info"]
            assert meta["id"] == rid
            assert meta["finish_reason"]["type"] == "length"
            assert meta["completion_tokens"] == 8 == len(meta["output_token_logprobs"])
        tokens, steps = after[0] - before[0], after[1] - before[1]
        assert tokens == 6 * 8
        assert steps < tokens, "requests were decoded one at a time"

    run(body)


def test_abort_mid_generation_returns_partial(engine: Engine) -> None:
    async def body() -> None:
        rid = f"abort-{uuid.uuid4().hex}"
        async with httpx.AsyncClient(base_url=engine.url, timeout=30) as client:
            pending = asyncio.create_task(client.post("/generate", json=slow_body(rid)))
            await wait_generating(client, rid)
            assert rid in (await client.get("/get_model_info")).json()["active_rids"]
            dup = await client.post("/generate", json=slow_body(rid))
            assert dup.status_code == 400 and "already active" in dup.json()["detail"]
            r = await client.post("/abort_request", json={"rid": rid})
            assert r.json() == {"success": True, "aborted": [rid], "finished": []}
            out = (await pending).json()
            late = await client.post("/abort_request", json={"rid": rid})
            unknown = await client.post("/abort_request", json={"rid": f"never-{rid}"})
        meta = out["meta_info"]
        assert meta["finish_reason"]["type"] == "abort"
        assert 0 < meta["completion_tokens"] < 50
        assert len(out["output_ids"]) == meta["completion_tokens"] == len(meta["output_token_logprobs"])
        assert late.json() == {"success": False, "aborted": [], "finished": [rid]}  # rein: it ended here
        assert unknown.json() == {"success": False, "aborted": [], "finished": []}

    run(body)


def test_abort_requests_ends_many_rids_in_one_call(engine: Engine) -> None:
    """rein's ``/abort_requests``: running rids aborted now (partial answers), a finished one reported
    as finished, an unknown one in neither list, a repeated rid once."""

    async def body() -> None:
        tag = uuid.uuid4().hex
        running = [f"many-{i}-{tag}" for i in range(3)]
        done, never = f"done-{tag}", f"never-{tag}"
        async with httpx.AsyncClient(base_url=engine.url, timeout=30) as client:
            assert (await client.post("/generate", json=slow_body(done, max_new_tokens=1))).status_code == 200
            pending = [asyncio.create_task(client.post("/generate", json=slow_body(rid))) for rid in running]
            for rid in running:
                await wait_generating(client, rid)
            r = await client.post("/abort_requests", json={"rids": [*running, done, never, running[0]]})
            outs = [(await p).json() for p in pending]
            bad = await client.post("/abort_requests", json={"rid": running[0]})
        assert r.status_code == 200, r.text
        assert r.json() == {"success": True, "aborted": running, "finished": [done]}
        for out in outs:
            assert out["meta_info"]["finish_reason"]["type"] == "abort"
            assert 0 < out["meta_info"]["completion_tokens"] < 50
        assert bad.status_code == 422

    run(body)


def test_a_staged_checkpoint_is_swapped_in_unless_its_file_changed(engine: Engine) -> None:
    """rein's ``/stage_weights`` reads a checkpoint ahead; the update naming it then uses what was
    read (``staged``), except when the file changed since: then it reads the file again."""
    a_path, a_digest = engine.checkpoint("stage-a", seed=21)
    b_path, _ = engine.checkpoint("stage-b", seed=22)

    def post(route: str, path: Path | str) -> httpx.Response:
        return httpx.post(f"{engine.url}{route}", json={"model_path": str(path)}, timeout=30)

    staged = post("/stage_weights", a_path)
    assert staged.status_code == 200, staged.text
    assert staged.json() == {"success": True, "weight_version": "stage-a", "digest": a_digest}
    updated = post("/update_weights_from_disk", a_path).json()
    assert updated["staged"] is True and updated["digest"] == a_digest and updated["weight_version"] == "stage-a"
    assert engine.model_info()["digest"] == a_digest

    assert post("/stage_weights", b_path).status_code == 200
    b_digest = checkpoint.save(b_path, init_policy(CFG, 23), CFG, version="stage-b2", step=23)  # rewritten
    updated = post("/update_weights_from_disk", b_path).json()
    assert updated["staged"] is False and updated["digest"] == b_digest and updated["weight_version"] == "stage-b2"
    assert post("/update_weights_from_disk", a_path).json()["staged"] is False  # staging is used once

    outside = post("/stage_weights", "/etc/passwd")
    missing = post("/stage_weights", engine.weights_dir / "missing.pt")
    assert outside.status_code == missing.status_code == 400
    assert outside.json()["success"] is False and "outside" in outside.json()["message"]


def test_an_engine_told_not_to_stage_answers_404_as_one_without_the_route(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """``REIN_STAGE_WEIGHTS=false`` (a model whose second copy does not fit): the broadcaster's
    staging call gets SGLang's answer, and the update reads the file itself."""
    with temp_engine(tmp_path_factory, extra_env={"REIN_STAGE_WEIGHTS": "false"}) as plain:
        path, digest = plain.checkpoint("no-stage", seed=31)
        staged = httpx.post(f"{plain.url}/stage_weights", json={"model_path": str(path)}, timeout=30)
        assert staged.status_code == 404
        updated = httpx.post(f"{plain.url}/update_weights_from_disk", json={"model_path": str(path)}, timeout=30)
        assert updated.json()["staged"] is False and updated.json()["digest"] == digest


def test_update_weights_mid_generation(engine: Engine) -> None:
    version = f"v-{uuid.uuid4().hex[:8]}"
    dig = checkpoint.save(engine.weights_dir / f"{version}.pt", init_policy(CFG, 11), CFG, version=version, step=11)

    async def body() -> None:
        rid = f"swap-{uuid.uuid4().hex}"
        async with httpx.AsyncClient(base_url=engine.url, timeout=30) as client:
            old = (await client.get("/get_model_info")).json()["weight_version"]
            pending = asyncio.create_task(client.post("/generate", json=slow_body(rid, max_new_tokens=40)))
            await wait_generating(client, rid)
            path = str(engine.weights_dir / f"{version}.pt")
            r = await client.post("/update_weights_from_disk", json={"model_path": path})
            assert r.status_code == 200, r.text
            assert (r.json()["success"], r.json()["weight_version"], r.json()["digest"]) == (True, version, dig)
            info = (await client.get("/get_model_info")).json()
            assert (info["weight_version"], info["digest"], info["step"]) == (version, dig, 11)
            out = (await pending).json()
        meta = out["meta_info"]
        assert meta["weight_version"] == version
        versions = meta["output_token_weight_versions"]
        assert versions[0] == old and versions[-1] == version
        assert versions == sorted(versions, key=lambda v: v == version)  # old tokens, then new ones

    run(body)


def test_update_weights_refusals(engine: Engine, tmp_path: Path) -> None:
    outside = tmp_path / "outside.pt"
    checkpoint.save(outside, init_policy(CFG, 1), CFG, version="evil", step=1)
    with httpx.Client(base_url=engine.url, timeout=10) as client:
        before = client.get("/get_model_info").json()
        for path in (str(outside), "../outside.pt", "missing.pt"):
            r = client.post("/update_weights_from_disk", json={"model_path": path})
            assert r.status_code == 400, r.text
            assert r.json()["success"] is False
        assert client.get("/get_model_info").json()["digest"] == before["digest"]


def test_malformed_bodies(engine: Engine) -> None:
    with httpx.Client(base_url=engine.url, timeout=10) as client:
        r = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": "x"}})
        assert r.status_code == 422 and "max_new_tokens" in r.text
        assert (
            client.post("/generate", content=b"{not json", headers={"content-type": "application/json"}).status_code
            == 422
        )
        assert client.post("/update_weights_from_disk", json={}).status_code == 422
        r = client.post("/generate", json={"input_ids": list(range(6, 38)) * 3})
        assert r.status_code == 400 and "context window" in r.text
        assert client.get("/health").json() == {"status": "ok"}
