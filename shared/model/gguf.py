"""One-time conversion of a GGUF file into a Hugging Face safetensors directory.

Transformers can read a GGUF (dequantizing it to fp32, ~25 s for SmolLM2-135M) but not
save it back ("quantized with gguf and is not serializable"). So the loaded weights are
copied into a fresh model built from the same config (minus ``quantization_config``)
and that model and the tokenizer are saved. Every later load reads the directory
(~0.3 s), and engine, trainer and SGLang all read the same format.

The directory is keyed by the GGUF's size and sha256 (``rein-source.json`` inside): a
changed file converts again, an unchanged one returns at once. The conversion writes
into a temp directory and renames it into place, under an exclusive lock, so two
processes never convert at once and a reader never sees half a directory.

Run as ``python -m shared.model.gguf FILE.gguf [TARGET_DIR]``: prints the directory.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from shared.model.base import ModelError
from shared.settings import rein_cache

SOURCE_FILE = "rein-source.json"
"""Marker inside a converted directory: which GGUF (name, size, sha256) it came from."""


def source_key(path: Path) -> dict[str, Any]:
    """``{name, size, sha256}`` of a GGUF file (the conversion's cache key)."""
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return {"name": path.name, "size": path.stat().st_size, "sha256": h.hexdigest()}


def default_target(gguf_path: Path, key: dict[str, Any], cache_dir: Path | None = None) -> Path:
    """``<cache>/models/<stem>-<sha12>`` (stem lower-cased)."""
    return (cache_dir or rein_cache()) / "models" / f"{gguf_path.stem.lower()}-{key['sha256'][:12]}"


def is_converted(target: Path, key: dict[str, Any]) -> bool:
    """True when ``target`` holds a finished conversion of the file ``key`` describes."""
    try:
        found = json.loads((target / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(found, dict) and found.get("size") == key["size"] and found.get("sha256") == key["sha256"]


@contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _write_directory(gguf_path: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shared.model.hf import finish_directory  # also silences transformers' progress bars

    where, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name, local_files_only=True)
    loaded = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, local_files_only=True, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    fresh.load_state_dict(loaded.state_dict())
    del loaded
    fresh.save_pretrained(out)
    tokenizer.save_pretrained(out)
    finish_directory(out)


def convert(gguf_path: Path, target: Path, key: dict[str, Any] | None = None) -> Path:
    """Convert ``gguf_path`` into the HF directory ``target`` unless it already holds it; returns ``target``."""
    if not gguf_path.is_file():
        raise ModelError(f"no GGUF file at {gguf_path}")
    key = key or source_key(gguf_path)
    if is_converted(target, key):
        return target
    with _locked(target.parent / f".{target.name}.lock"):
        if is_converted(target, key):  # another process finished it while we waited
            return target
        tmp = target.parent / f".{target.name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        started = time.monotonic()
        try:
            _write_directory(gguf_path, tmp)
        except Exception as exc:  # gguf/transformers raise many types for a bad file; normalise them
            shutil.rmtree(tmp, ignore_errors=True)
            raise ModelError(f"cannot convert {gguf_path}: {exc}") from exc
        (tmp / SOURCE_FILE).write_text(
            json.dumps({**key, "converted_s": round(time.monotonic() - started, 1)}, sort_keys=True)
        )
        old = target.parent / f".{target.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        if target.exists():
            target.rename(old)
        tmp.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    return target


def convert_cached(gguf_path: Path, *, cache_dir: Path | None = None) -> Path:
    """The converted directory of ``gguf_path`` under ``<cache>/models/``, converting it on first use."""
    if not gguf_path.is_file():
        raise ModelError(f"no GGUF file at {gguf_path}")
    key = source_key(gguf_path)
    return convert(gguf_path, default_target(gguf_path, key, cache_dir), key)


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print("usage: python -m shared.model.gguf FILE.gguf [TARGET_DIR]", file=sys.stderr)
        return 2
    source = Path(argv[0])
    out = convert(source, Path(argv[1])) if len(argv) == 2 else convert_cached(source)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
