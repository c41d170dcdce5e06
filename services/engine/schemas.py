"""HTTP bodies of the SGLang native API subset the engine serves.

Unknown fields are refused (422 naming the field) so a client relying on an SGLang
feature this engine lacks finds out at once. A few SGLang fields that change nothing
here are accepted and ignored (``return_text_in_logprobs``, ``logprob_start_len``,
``no_stop_trim``).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class SamplingParamsBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = Field(default=128, ge=0)
    temperature: float = Field(default=1.0, ge=0.0)
    """0 means greedy."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = -1
    """-1 (or any value <= 0) disables top-k."""
    stop_token_ids: list[int] | None = None
    """Extra stop tokens; ``<|end|>`` always stops unless ``ignore_eos`` (SGLang's EOS rule)."""
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    """Stop strings: the generation ends with the token that completes one (kept in ``output_ids``)."""
    skip_special_tokens: bool = True
    """Drop special tokens from ``text`` (never from ``output_ids``)."""
    no_stop_trim: bool = False


class GenerateBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_ids: list[int]
    sampling_params: SamplingParamsBody = Field(default_factory=SamplingParamsBody)
    return_logprob: bool = False
    rid: str | None = Field(default=None, min_length=1, max_length=256)
    """Request id for /abort_request. Exact match here; real SGLang matches by prefix, so
    clients must never use a rid that is a prefix of another."""
    stream: bool = False
    return_text_in_logprobs: bool = True
    logprob_start_len: int = -1


class AbortBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rid: str = ""
    abort_all: bool = False


class AbortManyBody(BaseModel):
    """rein's ``/abort_requests``: many rids in one call (SGLang has no such route)."""

    model_config = ConfigDict(extra="forbid")

    rids: list[str] = Field(max_length=65536)


class StageWeightsBody(BaseModel):
    """rein's ``/stage_weights``: read a checkpoint ahead of ``/update_weights_from_disk``."""

    model_config = ConfigDict(extra="forbid")

    model_path: str = Field(min_length=1)


class UpdateWeightsBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_path: str = Field(min_length=1)
    weight_version: str | None = None
    """Label to serve; default: the version stored in the checkpoint."""
    abort_all_requests: bool = False
    load_format: str | None = None
    """Accepted for SGLang compatibility; only rein checkpoints are supported."""


def generate_response(
    *,
    rid: str,
    text: str,
    output_ids: list[int],
    finish_reason: dict[str, Any],
    prompt_tokens: int,
    weight_version: str | None,
    token_versions: list[str],
    logprobs: list[list[Any]] | None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish_reason,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(output_ids),
        "weight_version": weight_version,
        "output_token_weight_versions": token_versions,
    }
    if logprobs is not None:
        meta["output_token_logprobs"] = logprobs
    return {"text": text, "output_ids": output_ids, "meta_info": meta}
