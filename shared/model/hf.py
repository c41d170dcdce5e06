"""Any Hugging Face causal LM as a model family (``AutoModelForCausalLM`` + ``AutoTokenizer``).

A checkpoint is a directory the way ``save_pretrained`` writes it (``config.json``,
``model.safetensors``, tokenizer files) plus ``rein.json`` {format, version, step, digest}:
rein's engine loads it with :meth:`HFFamily.load`, SGLang with ``/update_weights_from_disk``.
It is written into a temp directory beside the target and renamed into place, so a reader
never sees half a checkpoint. Nothing here touches the hub: every load is
``local_files_only``.

dtype: fp32 on CPU, bf16 on CUDA, unless the caller asks otherwise (the trainer keeps fp32
master weights and autocasts). The digest is of the weights as stored, so the engine and
the trainer agree on it whatever dtype each computes in.
"""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from shared.checkpoint import CheckpointError
from shared.durable import fsync_path, fsync_tree
from shared.model.base import ChatTokenizer, Loaded, ModelError, state_digest
from shared.model.hf_chat import HFChatTokenizer

hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # services log JSON lines; tqdm bars on every load are noise

SIDECAR = "rein.json"
FORMAT = 1


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def finish_directory(directory: Path) -> None:
    """Make a saved directory readable by any reader: older transformers (SGLang's) and other users.

    Transformers 5 writes ``dtype`` and ``rope_parameters``; releases before it read ``torch_dtype``
    and a top-level ``rope_theta`` (without which they silently assume 10000). Both spellings are
    kept. Files are made world-readable (``save_pretrained`` writes weights 0600), so an engine
    running as another user (a container) can load them.
    """
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    if "dtype" in config and "torch_dtype" not in config:
        config["torch_dtype"] = config["dtype"]
    rope = config.get("rope_parameters")
    if isinstance(rope, Mapping) and "rope_theta" in rope and "rope_theta" not in config:
        config["rope_theta"] = rope["rope_theta"]
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for path in directory.rglob("*"):
        if path.is_file():
            path.chmod(0o644)


def _swap_in(tmp: Path, target: Path) -> None:
    """Rename ``tmp`` to ``target``; an existing ``target`` (a retrained step) is moved aside first."""
    old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
    if target.exists():
        target.rename(old)
    tmp.rename(target)
    shutil.rmtree(old, ignore_errors=True)
    fsync_path(target.parent)


class HFFamily:
    """The HF model in ``directory``: its tokenizer, its pretrained weights, directory checkpoints."""

    def __init__(self, directory: Path, *, context_cap: int | None = None) -> None:
        self.directory = directory.resolve()
        try:
            self.config = AutoConfig.from_pretrained(self.directory, local_files_only=True)
            tokenizer = AutoTokenizer.from_pretrained(self.directory, local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            raise ModelError(f"cannot load the Hugging Face model in {self.directory}: {exc}") from exc
        self._tokenizer = HFChatTokenizer(tokenizer, self._generation_eos())
        window = getattr(self.config, "max_position_embeddings", None) or tokenizer.model_max_length
        self._context = int(min(window, context_cap) if context_cap else window)

    def _generation_eos(self) -> list[int]:
        try:
            found = json.loads((self.directory / "generation_config.json").read_text()).get("eos_token_id")
        except (OSError, ValueError):
            return []
        return [found] if isinstance(found, int) else [i for i in found or [] if isinstance(i, int)]

    @property
    def name(self) -> str:
        return self.directory.name

    @property
    def kind(self) -> Literal["tiny", "hf"]:
        return "hf"

    @property
    def tokenizer(self) -> ChatTokenizer:
        return self._tokenizer

    @property
    def context_window(self) -> int:
        return self._context

    @property
    def checkpoint_suffix(self) -> str:
        return ""

    def _from_directory(self, directory: Path, dtype: torch.dtype | str) -> nn.Module:
        model: nn.Module = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, local_files_only=True)
        model.eval()
        return model

    def new_model(self, seed: int, device: torch.device, *, dtype: torch.dtype | None = None) -> nn.Module:
        model = self._from_directory(self.directory, dtype or default_dtype(device))
        return model.to(device)

    def save(self, model: nn.Module, path: Path, *, version: str, step: int) -> str:
        path = path.resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            model.save_pretrained(tmp)  # type: ignore[operator]
            self._tokenizer.inner.save_pretrained(tmp)
            finish_directory(tmp)
            digest = self.digest(model)
            body = {"format": FORMAT, "version": str(version), "step": int(step), "digest": digest}
            (tmp / SIDECAR).write_text(json.dumps(body, sort_keys=True))
            fsync_tree(tmp)
            _swap_in(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return digest

    def load(self, path: Path, device: torch.device, *, dtype: torch.dtype | None = None) -> Loaded:
        if not path.is_dir():
            raise FileNotFoundError(f"no checkpoint directory at {path}")
        try:
            meta = json.loads((path / SIDECAR).read_text())
            version, step, want = str(meta["version"]), int(meta["step"]), str(meta["digest"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"checkpoint {path} has no usable {SIDECAR}: {exc}") from exc
        try:
            model = self._from_directory(path, "auto")
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc
        actual = self.digest(model)
        if actual != want:
            raise CheckpointError(f"checkpoint {path} digest mismatch: {SIDECAR} says {want}, weights hash to {actual}")
        model = model.to(device=device, dtype=dtype or default_dtype(device))
        return Loaded(model=model, version=version, step=step, digest=actual)

    def digest(self, model: nn.Module) -> str:
        return state_digest(model.state_dict())
