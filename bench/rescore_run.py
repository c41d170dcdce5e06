"""Re-score a finished tiny-policy demo run: where its train-vs-rollout logprob diff comes from.

Reads the run's own records offline (no broker: the Kafka log segments the local stack left in
``RUN/infra/kafka/kraft-logs``, uncompressed record batches) and its checkpoints ``RUN/weights/v<k>.pt``.
For each manifest (index ``i``, trained on the weights ``v<i>``) it builds the samples as the
trainer does and splits the trained tokens by their gap to the trainer's weights (``i`` minus the
index of the version that sampled them). Per gap it prints the mean |trainer - rollout logprob|
under the trainer's weights and under the token's own labelled version (the latter ~1e-7 when
labels and numerics are right), and the steps where the collector's reported gap lagged the
trainer's. Prints a table and writes JSON. Usage::

    $(bash deploy/venv.sh --path)/bin/python bench/rescore_run.py runs/20261203-125348 --out /tmp/rescore.json
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
from collections import defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.trainer.samples import build_samples
from shared.model.tiny import TinyFamily
from shared.policy import token_logprobs
from shared.schemas import BatchManifest, CompletedGroup, Record, decode


def _varint(b: bytes, i: int) -> tuple[int, int]:
    shift = raw = 0
    while True:
        x = b[i]
        i += 1
        raw |= (x & 0x7F) << shift
        shift += 7
        if not x & 0x80:
            return (raw >> 1) ^ -(raw & 1), i


def _values(path: Path) -> Iterator[tuple[int, bytes]]:
    """``(offset, value)`` of each record of one segment file (record batch format v2, uncompressed)."""
    b, i = path.read_bytes(), 0
    while i + 61 <= len(b):
        base, length = struct.unpack(">qi", b[i : i + 12])
        attrs = struct.unpack(">h", b[i + 21 : i + 23])[0]
        if attrs & 7:
            raise SystemExit(f"{path}: compressed record batch (codec {attrs & 7}) not supported")
        count, j = struct.unpack(">i", b[i + 57 : i + 61])[0], i + 61
        for _ in range(0 if attrs & 0x20 else count):  # 0x20: a transaction control batch
            size, j = _varint(b, j)
            end = j + size
            _, j = _varint(b, j + 1)  # attributes byte, timestamp delta
            delta, j = _varint(b, j)
            key_len, j = _varint(b, j)
            value_len, j = _varint(b, j + max(key_len, 0))
            if value_len >= 0:
                yield base + delta, b[j : j + value_len]
            j = end
        i += 12 + length


def read_topic(logs: Path, topic: str) -> dict[tuple[int, int], Record]:
    return {(int(d.name.rsplit("-", 1)[1]), offset): decode(value)
            for d in sorted(logs.glob(f"{topic}-*")) for f in sorted(d.glob("*.log")) for offset, value in _values(f)}


def rescore(run: Path) -> dict[str, Any]:
    logs = run / "infra" / "kafka" / "kraft-logs"
    groups = read_topic(logs, "rollout.groups")
    manifests = {m.index: m for m in read_topic(logs, "train.batches").values() if isinstance(m, BatchManifest)}
    family, models = TinyFamily(), {}

    def model(version: str) -> torch.nn.Module:
        if version not in models:
            models[version] = family.load(run / "weights" / f"{version}.pt", torch.device("cpu")).model
        return models[version]

    steps = []
    for index in sorted(manifests):
        m = manifests[index]
        chosen = [groups[(ref.partition, ref.offset)] for ref in m.groups]
        batch = build_samples([g for g in chosen if isinstance(g, CompletedGroup)], max_tokens=64)
        held = f"v{index}"
        by_gap: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])  # sum held, sum own, count
        for s in batch.samples:
            ids = torch.tensor([s.token_ids])
            with torch.no_grad():
                scored = {v: token_logprobs(model(v), ids)[0] for v in {held, *(v for v in s.versions if v)}}
            for t, (kept, v) in enumerate(zip(s.loss_mask, s.versions, strict=True)):
                if kept and v is not None:
                    e = by_gap[index - int(v[1:])]
                    e[0] += abs(float(scored[held][t - 1]) - s.rollout_logprobs[t])
                    e[1] += abs(float(scored[v][t - 1]) - s.rollout_logprobs[t])
                    e[2] += 1
        n = sum(e[2] for e in by_gap.values())
        steps.append({
            "step": index + 1, "collector_lag": index - m.window.current_index if m.window.current_index is not None
            else None, "reported_gap_mean": m.version_gap.mean if m.version_gap else None,
            "diff": sum(e[0] for e in by_gap.values()) / n if n else None,
            "by_gap": {g: {"tokens": int(e[2]), "diff_held": e[0] / e[2], "diff_own": e[1] / e[2]}
                       for g, e in sorted(by_gap.items())},
        })
    same = [s["by_gap"][0] for s in steps if 0 in s["by_gap"]]
    return {
        "run": str(run), "steps": len(steps),
        "trained_tokens": sum(g["tokens"] for s in steps for g in s["by_gap"].values()),
        "same_version_tokens": sum(g["tokens"] for g in same),
        "same_version_diff_max": max((g["diff_held"] for g in same), default=None),
        "own_version_diff_max": max((g["diff_own"] for s in steps for g in s["by_gap"].values()), default=None),
        "collector_lagged_steps": sum(1 for s in steps if s["collector_lag"]),
        "per_step": steps,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("runs", nargs="+", type=Path, help="run directories of make demo (runs/<id>)")
    p.add_argument("--out", type=Path, default=Path("/tmp/rein-bench-rescore.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    results = [rescore(run) for run in args.runs]
    print(f"{'run':<18} {'steps':>5} {'lagged':>6} {'tokens':>7} {'same-ver':>8} {'same max':>9} {'own max':>9}"
          "  top diff steps")
    for r in results:
        top = sorted(r["per_step"], key=lambda s: s["diff"] or 0.0, reverse=True)[:3]
        tops = ", ".join(f"{s['step']}: {s['diff']:.3g}" for s in top)
        print(f"{Path(r['run']).name:<18} {r['steps']:>5} {r['collector_lagged_steps']:>6} {r['trained_tokens']:>7} "
              f"{r['same_version_tokens']:>8} {r['same_version_diff_max']:>9.2e} {r['own_version_diff_max']:>9.2e}"
              f"  {tops}")
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
