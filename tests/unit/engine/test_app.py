"""The HTTP shell in-process (TestClient): bodies, status codes, metrics."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from services.engine.app import create_app
from services.engine.settings import EngineSettings
from shared import checkpoint
from shared.policy import PolicyConfig, init_policy
from shared.settings import SettingsError, load
from shared.tokenizer import TOKENIZER

PROMPT = TOKENIZER.apply_chat_template([{"role": "user", "content": "guess"}], add_generation_prompt=True)


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    settings = EngineSettings(weights_dir=tmp_path, max_request_bytes=4096, seed=3)
    with TestClient(create_app(settings)) as c:
        yield c


def test_generate_shape(client: TestClient) -> None:
    body = {"input_ids": PROMPT, "rid": "x1", "return_logprob": True,
            "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}
    out = client.post("/generate", json=body).json()
    meta = out["meta_info"]
    assert meta["id"] == "x1"
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["weight_version"]) == (len(PROMPT), 5, "v0")
    assert [tok for _, tok, _ in meta["output_token_logprobs"]] == out["output_ids"]
    assert [text for _, _, text in meta["output_token_logprobs"]] == [
        TOKENIZER.id_to_token(t) for t in out["output_ids"]
    ]
    assert meta["output_token_weight_versions"] == ["v0"] * 5
    assert out["text"] == TOKENIZER.decode(out["output_ids"])
    plain = client.post("/generate", json={"input_ids": PROMPT}).json()
    assert "output_token_logprobs" not in plain["meta_info"]
    assert len(plain["meta_info"]["id"]) == 32


def test_errors(client: TestClient) -> None:
    r = client.post("/generate", json={"input_ids": "nope"})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "input_ids"]
    r = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"frequency_penalty": 1}})
    assert r.status_code == 422 and "frequency_penalty" in r.text
    r = client.post("/generate", json={"input_ids": [1] * 65})
    assert r.status_code == 400 and "context window of 64" in r.json()["detail"]
    assert client.post("/generate", json={"input_ids": PROMPT, "stream": True}).status_code == 400
    r = client.post("/generate", content=b"[" + b"1," * 3000 + b"1]", headers={"content-type": "application/json"})
    assert r.status_code == 413
    r = client.post("/update_weights_from_disk", json={"model_path": "/etc/passwd"})
    assert r.status_code == 400 and r.json()["success"] is False and "outside" in r.json()["message"]
    assert r.json()["num_paused_requests"] == 0
    r = client.post("/abort_request", json={"rid": "unknown"})
    assert r.status_code == 200 and r.json() == {"success": False, "aborted": [], "finished": []}


def test_info_health_metrics(client: TestClient, tmp_path: Path) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    assert client.post("/flush_cache").json() == {"success": True}
    info = client.get("/get_model_info").json()
    expected = checkpoint.digest(init_policy(PolicyConfig(vocab_size=TOKENIZER.vocab_size), 3).state_dict())
    sglang_fields = {"model_path", "tokenizer_path", "is_generation", "preferred_sampling_params", "weight_version"}
    assert sglang_fields <= info.keys() and info["is_generation"] is True
    assert (info["weight_version"], info["digest"], info["vocab_size"]) == ("v0", expected, 54)
    assert info["active_requests"] == 0 and info["model_path"] is None
    assert client.get("/get_weight_version").json() == {"weight_version": "v0"}
    server = client.get("/get_server_info").json()
    assert (server["context_length"], server["max_req_input_len"], server["max_running_requests"]) == (64, 64, 256)
    assert client.get("/model_info").status_code == 404  # SGLang's names only
    client.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
    cfg = PolicyConfig(vocab_size=TOKENIZER.vocab_size)
    dig = checkpoint.save(tmp_path / "c.pt", init_policy(cfg, 9), cfg, version="v9", step=9)
    r = client.post("/update_weights_from_disk", json={"model_path": "c.pt"}).json()
    assert (r["success"], r["num_paused_requests"], r["weight_version"], r["digest"]) == (True, 0, "v9", dig)
    assert isinstance(r["message"], str)
    assert client.get("/get_model_info").json()["weight_version"] == "v9"
    text = client.get("/metrics").text
    assert 'rein_engine_requests_total{finish_reason=' in text
    assert "rein_engine_batch_size_bucket" in text
    assert f'rein_engine_weight_info{{digest="{dig}",weight_version="v9"}} 1.0' in text
    assert "rein_engine_active_requests 0.0" in text


def test_settings_validation(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="inside weights_dir"):
        load(EngineSettings, weights_dir=tmp_path / "w", model_path=tmp_path / "x.pt")
    with pytest.raises(SettingsError, match="REIN_STEP_DELAY_S"):
        load(EngineSettings, weights_dir=tmp_path, step_delay_s=-1)
    ok = load(EngineSettings, weights_dir=tmp_path, model_path="a.pt")
    assert ok.resolved_model_path() == (tmp_path / "a.pt").resolve()
