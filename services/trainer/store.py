"""The trainer's durable state on disk: checkpoints, sidecars and ``metrics.jsonl``.

Per durable step ``s`` the weights dir holds, written in this order:

1. ``v<s>.pt`` (tiny) or ``v<s>/`` (an HF directory with ``rein.json``) — the policy, written by the
   model family's ``save`` (temp file or directory + rename, digest inside);
2. ``v<s>.optim.pt`` — AdamW state (temp file + rename), so a resumed run continues the same optimisation;
3. ``v<s>.json`` — the sidecar: version, step, digest, ``last_index`` (the last manifest index
   folded into these weights) and the metrics lines of the manifests it made durable. A manifest
   consumed without an update (no gradient) moves ``last_index`` on by rewriting the newest
   sidecar alone (:func:`advance`).

The sidecar is the commit point: a step counts as trained only once its sidecar
exists, and :func:`latest` resumes from the newest sidecar whose checkpoint loads
and matches its digest. ``metrics.jsonl`` is appended only after the sidecar, and
:func:`reconcile_metrics` restores lines a crash lost in between, so the file has
exactly one line per durable manifest (a step, or a batch skipped; told apart by index).
With ``keep`` set, :func:`prune` deletes all but the newest ``keep`` durable steps (an HF
checkpoint is hundreds of MB), sidecar first, so a half-pruned step is never taken for a
durable one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shared import log
from shared.durable import atomic_write, fsync_path
from shared.model import CheckpointError, Loaded, ModelFamily

_log = log.get(__name__)
_SIDECAR = re.compile(r"^v(\d+)\.json$")


def version_label(step: int) -> str:
    return f"v{step}"


def checkpoint_path(weights_dir: Path, step: int, suffix: str = ".pt") -> Path:
    """``v<step><suffix>``: the family's ``checkpoint_suffix`` (``.pt`` tiny, none for an HF directory)."""
    return weights_dir / f"v{step}{suffix}"


def optimizer_path(weights_dir: Path, step: int) -> Path:
    return weights_dir / f"v{step}.optim.pt"


def sidecar_path(weights_dir: Path, step: int) -> Path:
    return weights_dir / f"v{step}.json"


@dataclass(frozen=True)
class Sidecar:
    version: str
    step: int
    digest: str
    last_index: int
    """Index of the last manifest these weights include (first_index − 1 for step 0)."""
    path: str
    metrics: list[dict[str, Any]] = field(default_factory=list)
    """metrics.jsonl lines of the manifests made durable by this sidecar (since the previous one)."""


@dataclass(frozen=True)
class Resumed:
    sidecar: Sidecar
    checkpoint: Loaded
    optimizer_state: dict[str, Any] | None


def save_step(
    weights_dir: Path,
    family: ModelFamily,
    model: nn.Module,
    step: int,
    last_index: int,
    optimizer_state: dict[str, Any] | None,
    metrics: Iterable[dict[str, Any]] = (),
) -> Sidecar:
    """Write checkpoint, optimizer state and sidecar (in that order); returns the sidecar."""
    path = checkpoint_path(weights_dir, step, family.checkpoint_suffix).resolve()
    version = version_label(step)
    digest = family.save(model, path, version=version, step=step)
    fsync_path(path.parent)
    if optimizer_state is not None:
        atomic_write(optimizer_path(weights_dir, step), lambda fh: torch.save(optimizer_state, fh))
    sidecar = Sidecar(
        version=version, step=step, digest=digest, last_index=last_index, path=str(path), metrics=list(metrics)
    )
    body = json.dumps(asdict(sidecar), sort_keys=True).encode()
    atomic_write(sidecar_path(weights_dir, step), lambda fh: fh.write(body))
    return sidecar


def advance(weights_dir: Path, sidecar: Sidecar, last_index: int, metrics: Iterable[dict[str, Any]]) -> Sidecar:
    """Rewrite the newest sidecar with ``last_index`` moved on (atomically): manifests consumed without
    an update (no gradient) become durable with the weights they left as they were, and no new version."""
    moved = replace(sidecar, last_index=last_index, metrics=list(metrics))
    body = json.dumps(asdict(moved), sort_keys=True).encode()
    atomic_write(sidecar_path(weights_dir, sidecar.step), lambda fh: fh.write(body))
    return moved


def _read_sidecar(path: Path) -> Sidecar:
    data = json.loads(path.read_text())
    return Sidecar(**data)


def _durable_steps(weights_dir: Path) -> list[int]:
    """Steps with a sidecar, newest first."""
    return sorted((int(m.group(1)) for p in weights_dir.iterdir() if (m := _SIDECAR.match(p.name))), reverse=True)


def latest(
    weights_dir: Path, family: ModelFamily, device: torch.device, *, dtype: torch.dtype | None = None
) -> Resumed | None:
    """The newest durable step (sidecar + matching checkpoint), or None on a fresh weights dir."""
    if not weights_dir.is_dir():
        return None
    for step in _durable_steps(weights_dir):
        try:
            sidecar = _read_sidecar(sidecar_path(weights_dir, step))
            ckpt = family.load(checkpoint_path(weights_dir, step, family.checkpoint_suffix), device, dtype=dtype)
        except (OSError, ValueError, TypeError, CheckpointError) as exc:
            _log.error("checkpoint_unusable", step=step, error=str(exc))
            continue
        if ckpt.digest != sidecar.digest or ckpt.step != step:
            _log.error("checkpoint_mismatch", step=step, sidecar_digest=sidecar.digest, digest=ckpt.digest)
            continue
        opt_file = optimizer_path(weights_dir, step)
        opt_state = torch.load(opt_file, map_location="cpu", weights_only=True) if opt_file.exists() else None
        return Resumed(sidecar=sidecar, checkpoint=ckpt, optimizer_state=opt_state)
    return None


def prune(weights_dir: Path, family: ModelFamily, keep: int) -> list[int]:
    """Delete every durable step but the newest ``keep`` (sidecar, then checkpoint and optimizer state).

    Returns the steps deleted. An engine still loading a deleted version fails that load and keeps
    its weights; with ``keep`` >= 2 the version just before the newest stays loadable.
    """
    if keep <= 0 or not weights_dir.is_dir():
        return []
    dropped = _durable_steps(weights_dir)[keep:]
    for step in dropped:
        sidecar_path(weights_dir, step).unlink(missing_ok=True)
        target = checkpoint_path(weights_dir, step, family.checkpoint_suffix)
        if target.is_dir():
            shutil.rmtree(target, ignore_errors=True)
        else:
            target.unlink(missing_ok=True)
        optimizer_path(weights_dir, step).unlink(missing_ok=True)
    return dropped


class MetricsLog:
    """Append-only ``metrics.jsonl``: one JSON object per durable manifest (a step, or a batch skipped)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def indices(self) -> set[int]:
        """Manifest indices already recorded; a torn last line (crash mid-append) is cut off first."""
        if not self.path.exists():
            return set()
        raw = self.path.read_bytes()
        if raw and not raw.endswith(b"\n"):
            cut = raw.rfind(b"\n") + 1
            with self.path.open("r+b") as fh:
                fh.truncate(cut)
            raw = raw[:cut]
        return {int(json.loads(line)["manifest_index"]) for line in raw.decode().splitlines() if line.strip()}

    def append(self, lines: Iterable[dict[str, Any]]) -> None:
        text = "".join(json.dumps(line, sort_keys=True) + "\n" for line in lines)
        if not text:
            return
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())


def reconcile_metrics(metrics_log: MetricsLog, sidecar: Sidecar) -> int:
    """Append the sidecar's lines that a crash kept out of ``metrics.jsonl``; returns how many."""
    have = metrics_log.indices()
    missing = [line for line in sidecar.metrics if int(line["manifest_index"]) not in have]
    metrics_log.append(missing)
    return len(missing)
