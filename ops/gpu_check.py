"""The GPU path in one run: rein's proxy in front of a real SGLang server serving a Hugging Face model.

``deploy/gpu-check.sh OUT`` prepares the venvs and the model, then runs ``python -m ops.gpu_check``,
which starts Kafka and Redis (``ops.local.launcher.Infra``), SGLang (its own Python, given by
``--sglang-python``) and rein's proxy, and checks, in order:

1. SGLang answers ``/get_model_info`` and ``/get_server_info`` with the fields rein reads;
2. a chat call through the proxy with the official ``openai`` client is answered and its chunk on
   ``rollout.chunks`` carries the engine's sampled ids and per-token versions;
3. pause while a long generation runs: the proxy aborts it on SGLang and holds the call;
4. a trainer checkpoint (``family.save``: an HF directory with rein's sidecar) is loaded with
   ``/update_weights_from_disk`` under a new ``weight_version``;
5. resume on that version: the held call completes, and its tokens carry both versions;
6. ``/get_model_info`` reports the new version.

Every step's result goes to ``OUT/results.json`` (``ok`` per step, the answers, timings), so a
partial run still tells how far it got. Exit status 0 only when every step passed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import torch

from ops.local.credentials import Credentials
from ops.local.launcher import Infra, Service
from ops.local.ports import free_port
from shared import bus
from shared.model import load_family
from shared.names import Topics
from shared.schemas import Chunk
from shared.settings import KafkaSettings

CREDENTIALS = Credentials.new("gpu-check")
ADMIN = CREDENTIALS.admin_token


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Until ``url`` answers 200 (or the process died, or the time is up)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{url} not ready within {timeout_s:.0f}s")


class Report:
    """Step results, rewritten to ``results.json`` after every step."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.steps: list[dict[str, Any]] = []

    def step(self, name: str, check: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        start = time.monotonic()
        try:
            detail = check()
            entry = {"step": name, "ok": True, **detail}
        except Exception as exc:  # every failure is a result to write down
            entry = {"step": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
        entry["seconds"] = round(time.monotonic() - start, 2)
        self.steps.append(entry)
        (self.out / "results.json").write_text(json.dumps({"steps": self.steps}, indent=2, default=str))
        print(json.dumps(entry, default=str), flush=True)
        if not entry["ok"]:
            raise SystemExit(1)
        return entry


def chunks_of(kafka: KafkaSettings, session_id: str) -> list[Chunk]:
    records = bus.read_topic(kafka, Topics().chunks, timeout_s=30)
    return [r for r in records if isinstance(r, Chunk) and r.session_id == session_id]


def main(argv: list[str] | None = None) -> int:
    doc = __doc__.splitlines()[0] if __doc__ else None
    p = argparse.ArgumentParser(prog="python -m ops.gpu_check", description=doc)
    p.add_argument("out", type=Path)
    p.add_argument("--model", type=Path, required=True, help="Hugging Face directory SGLang serves")
    p.add_argument("--sglang-python", default=sys.executable, help="the Python that has sglang installed")
    p.add_argument("--mem-fraction", type=float, default=0.5)
    p.add_argument("--engine-url", help="use this running engine instead of starting SGLang (a dry run on CPU "
                   "against rein's own engine checks the script itself)")
    p.add_argument("--long-tokens", type=int, default=1024, help="reply budget of the call held across the update")
    args = p.parse_args(argv)
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    report = Report(out)
    family = load_family(str(args.model))
    weights = out / "weights"
    weights.mkdir(exist_ok=True)

    infra = Infra.start(out / "infra")
    kafka = KafkaSettings(bootstrap_servers=infra.kafka_bootstrap)
    sglang_port, proxy_port = free_port(), free_port()
    engine = args.engine_url or f"http://127.0.0.1:{sglang_port}"
    sglang_log = (out / "sglang.log").open("wb")
    sglang = None if args.engine_url else subprocess.Popen(
        [args.sglang_python, "-m", "sglang.launch_server", "--model-path", str(args.model), "--host", "127.0.0.1",
         "--port", str(sglang_port), "--mem-fraction-static", str(args.mem_fraction), "--context-length", "2048"],
        stdout=sglang_log, stderr=subprocess.STDOUT,
    )
    proxy: Service | None = None
    try:
        bus.ensure_topology(kafka, Topics(), 1)

        def sglang_up() -> dict[str, Any]:
            wait_http(f"{engine}/health", 420, sglang)
            info = httpx.get(f"{engine}/get_model_info", timeout=10).json()
            server = httpx.get(f"{engine}/get_server_info", timeout=10).json()
            assert "weight_version" in info, f"no weight_version in /get_model_info: {sorted(info)}"
            return {"model_info": info, "context_length": server.get("context_length"),
                    "max_req_input_len": server.get("max_req_input_len"), "sglang_version": server.get("version")}

        report.step("sglang_serves_the_model", sglang_up)
        proxy = Service(
            "proxy", "services.proxy",
            {"REIN_PORT": str(proxy_port), "REIN_ENGINE_URLS": json.dumps([engine]), **CREDENTIALS.proxy_env(),
             "REIN_MODEL": str(args.model), "REIN_KAFKA__BOOTSTRAP_SERVERS": infra.kafka_bootstrap,
             "REIN_REDIS__URL": infra.redis_url, "REIN_PARTIAL_ROLLOUT": "true"},
            f"http://127.0.0.1:{proxy_port}/health", out / "proxy.log",
        )
        proxy.start()
        proxy.wait_healthy(120)
        base = f"http://127.0.0.1:{proxy_port}"
        admin = {"Authorization": f"Bearer {ADMIN}"}

        def call(session: str, max_tokens: int) -> Any:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key=CREDENTIALS.runner_token, timeout=300, max_retries=0,
                                   default_headers={"X-Session-Id": session, "X-Group-Id": f"g-{session}"})
            try:
                return client.chat.completions.create(
                    model="smollm2", max_tokens=max_tokens, temperature=1.0,
                    messages=[{"role": "user", "content": "Write a long story about a lighthouse keeper. 🌊"}],
                )
            finally:
                client.close()

        def one_call() -> dict[str, Any]:
            session = f"s-{uuid.uuid4().hex[:8]}"
            answer = call(session, 24)
            got = chunks_of(kafka, session)
            assert got, "no chunk on rollout.chunks for the call"
            versions = got[0].output_versions()
            assert len(versions) == len(got[0].output_ids) and all(v is not None for v in versions), versions
            return {"text": answer.choices[0].message.content, "output_ids": len(got[0].output_ids),
                    "versions": sorted({str(v) for v in versions})}

        first = report.step("chat_through_proxy", one_call)
        old_version = first["versions"][0]

        held: dict[str, Any] = {}
        session = f"s-{uuid.uuid4().hex[:8]}"

        def long_call() -> None:
            try:
                held["answer"] = call(session, args.long_tokens)
            except Exception as exc:  # reported by the resume step
                held["error"] = repr(exc)

        worker = threading.Thread(target=long_call, daemon=True)

        def pause_aborts() -> dict[str, Any]:
            worker.start()
            time.sleep(3.0)  # let SGLang decode some tokens of the long reply before the pause
            resp = httpx.post(f"{base}/v1/rollout/pause", json={"pause_id": "gpu-check"}, headers=admin, timeout=60)
            resp.raise_for_status()
            return {"pause": resp.json()}

        report.step("pause_aborts_in_flight", pause_aborts)

        def update() -> dict[str, Any]:
            model = family.new_model(0, torch.device("cpu"), dtype=torch.float32)
            with torch.no_grad():
                for param in model.parameters():
                    param.mul_(1.0 + 1e-3)
            path = weights / "step-000001"
            digest = family.save(model, path, version="v1", step=1)
            resp = httpx.post(f"{engine}/update_weights_from_disk",
                              json={"model_path": str(path), "weight_version": "v1"}, timeout=300)
            body = resp.json()
            assert resp.status_code == 200 and body.get("success"), body
            return {"answer": body, "digest": digest}

        report.step("update_weights_from_disk", update)

        def resume() -> dict[str, Any]:
            resp = httpx.post(f"{base}/v1/rollout/resume", json={"pause_id": "gpu-check", "version": "v1"},
                              headers=admin, timeout=60)
            resp.raise_for_status()
            worker.join(600)
            assert "answer" in held, held.get("error", "the held call did not finish")
            versions = [str(v) for c in chunks_of(kafka, session) for v in c.output_versions()]
            assert old_version in versions and "v1" in versions, f"per-token versions {sorted(set(versions))}"
            return {"tokens": len(versions), "versions_in_order": list(dict.fromkeys(versions))}

        report.step("resume_on_new_version", resume)

        def served() -> dict[str, Any]:
            info = httpx.get(f"{engine}/get_model_info", timeout=10).json()
            assert info.get("weight_version") == "v1", info
            return {"model_info": info}

        report.step("engine_reports_new_version", served)
        return 0
    finally:
        if proxy is not None:
            proxy.stop()
        if sglang is not None:
            sglang.terminate()
            try:
                sglang.wait(30)
            except subprocess.TimeoutExpired:
                sglang.kill()
        sglang_log.close()
        infra.stop()


if __name__ == "__main__":
    sys.exit(main())
