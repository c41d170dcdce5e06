"""Incremental decoding with a KV cache, for every family of the model layer.

The engine asks one question per decode step: *the next-token logits of each of these
prefixes*. :meth:`Decoder.last_logits` answers it exactly as a full forward over each
prefix would (tested to 1e-4 in fp32), but keeps each request's keys and values so that a
prefix one token longer than last time costs one position, not the whole prefix again.

Layout: the rows being decoded share one left-padded cache per layer, ``[B, heads, L, d]``,
with a key mask ``[B, L]`` (False on padding) and each row's own length, which is also
the position of its next token. A step

1. drops the rows of requests no longer in the batch (finished, aborted, or evicted)
   and trims the padding columns no row needs any more;
2. decodes, in one batched forward, the rows whose prefix grew by exactly one token;
3. prefills every other prefix (a new request, a resumed one, or one whose cache was
   computed by other weights) and merges them into the padded cache. Prefixes of different
   lengths share a forward left-padded to the longest, with the key mask and per-row
   positions, as long as padding stays within ``max_padding`` of the forward's positions
   (:func:`prefill_groups`; equal lengths always share one; the default, 0, allows no padding:
   on CPU it costs about its share, see :data:`MAX_PADDING`).

Memory is ``rows x L`` positions per layer, with ``L`` the longest row: :attr:`Decoder.tokens`
reports it so the engine can bound it by a token budget. A decoder belongs to one set of
weights; after a weight swap the engine starts a new one and every row prefills again.

Families: the tiny policy (:meth:`shared.policy.TinyPolicy.forward_cached`) and Hugging
Face causal LMs (``cache``, formerly ``past_key_values``, as a ``DynamicCache``, ``attention_mask`` and per-row
``position_ids``). Any other module mapping ``ids[B,T] -> logits[B,T,V]`` (a test double
overriding ``TinyPolicy.forward``) is served by full recompute, so its forward is what runs.
"""

from __future__ import annotations

import inspect
from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch import nn

from shared.policy import KV, TinyPolicy

MAX_PADDING = 0.0
"""Default most share of a prefill forward's positions that may be padding (:func:`prefill_groups`): none,
since on CPU a position costs about the same in any forward, so padding costs about its share while the
forwards it saves are cheap (SmolLM2-135M, docs/benchmarks.md); an overhead-bound model or device may
want more (the engine's ``REIN_PREFILL_PADDING``)."""


class Decoder:
    """Next-token logits of many prefixes, each row's keys and values kept between calls.

    Not thread-safe: one thread (the engine's decode step) owns a decoder.
    """

    def __init__(
        self, model: nn.Module, *, pad_id: int = 0, use_cache: bool = True, max_padding: float = MAX_PADDING
    ) -> None:
        """``use_cache=False`` recomputes every prefix at every step (the reference, and benchmarks' baseline);
        ``max_padding`` bounds the padding of a prefill forward (:func:`prefill_groups`)."""
        if not 0.0 <= max_padding <= 1.0:
            raise ValueError(f"max_padding must be in [0, 1], got {max_padding}")
        self.model = model
        self.max_padding = max_padding
        self._pad_id = pad_id
        self._device = next(model.parameters()).device
        self._keys: list[Hashable] = []
        self._lengths: list[int] = []
        self._mask = torch.zeros(0, 0, dtype=torch.bool, device=self._device)
        self._kv: list[KV] = []
        self._kind = _kind(model) if use_cache else "recompute"
        self._hf_cache: Any = None
        """HF only: the ``DynamicCache`` holding ``_kv`` after a decode step, reused by the next
        one so a step appends in place instead of copying the cache into a new object."""

    # ---- accounting -----------------------------------------------------------------
    @property
    def tokens(self) -> int:
        """Positions held per layer, padding included (rows x longest row)."""
        return len(self._keys) * int(self._mask.shape[1])

    def rows(self) -> dict[Hashable, int]:
        """Cached length of each row."""
        return dict(zip(self._keys, self._lengths, strict=True))

    # ---- the one question -----------------------------------------------------------
    def last_logits(self, batch: Sequence[tuple[Hashable, Sequence[int]]]) -> torch.Tensor:
        """Logits at the last position of each ``(key, prefix)``: ``[B, V]`` float32 on CPU.

        Rows of keys absent from ``batch`` are freed first. A key whose cached length is
        ``len(prefix) - 1`` decodes the prefix's last token; any other prefix is prefilled
        (its previous row, if any, dropped). The caller guarantees that a key's prefix only
        ever grows by the token it appended (a new request gets a new key).
        """
        if not batch:
            self.clear()
            return torch.zeros(0, 0)
        if self._kind == "recompute":
            return _recompute_last(self.model, [p for _, p in batch], self._pad_id, self._device)
        self.retain([key for key, _ in batch])
        with torch.inference_mode():
            cached = dict(zip(self._keys, self._lengths, strict=True))
            step_keys = [k for k, p in batch if cached.get(k) == len(p) - 1]
            stale = {k for k, _ in batch if k in cached} - set(step_keys)
            if stale:
                self.retain([k for k in self._keys if k not in stale])
            out: dict[Hashable, torch.Tensor] = {}
            if step_keys:
                prefixes = dict(batch)
                last = [int(prefixes[k][-1]) for k in self._keys]
                out.update(zip(self._keys, self._decode(last), strict=True))
            fresh = [(k, p) for k, p in batch if k not in out]
            if fresh:
                out.update(self._prefill(fresh))
        return torch.stack([out[k] for k, _ in batch]).float().cpu()

    def retain(self, keys: Sequence[Hashable]) -> None:
        """Keep only the rows of ``keys`` (others are freed) and trim unneeded padding."""
        wanted = set(keys)
        if all(k in wanted for k in self._keys):
            return
        keep = [i for i, k in enumerate(self._keys) if k in wanted]
        self._keys = [self._keys[i] for i in keep]
        self._lengths = [self._lengths[i] for i in keep]
        if not keep:
            self.clear()
            return
        self._hf_cache = None
        index = torch.tensor(keep, device=self._device)
        start = int(self._mask.shape[1]) - max(self._lengths)
        self._mask = self._mask.index_select(0, index)[:, start:]
        self._kv = [(k.index_select(0, index)[:, :, start:], v.index_select(0, index)[:, :, start:])
                    for k, v in self._kv]

    def clear(self) -> None:
        """Free every row."""
        self._keys, self._lengths, self._kv, self._hf_cache = [], [], [], None
        self._mask = torch.zeros(0, 0, dtype=torch.bool, device=self._device)

    # ---- steps ----------------------------------------------------------------------
    def _decode(self, last: list[int]) -> list[torch.Tensor]:
        """One token for every cached row (in row order); grows each row by one."""
        ids = torch.tensor(last, dtype=torch.long, device=self._device)[:, None]
        positions = torch.tensor(self._lengths, dtype=torch.long, device=self._device)[:, None]
        mask = torch.cat([self._mask, torch.ones_like(self._mask[:, :1])], dim=1)
        if self._kind == "hf":
            past = self._hf_cache if self._hf_cache is not None else self._kv
            logits, self._hf_cache = _hf_forward(self.model, ids, positions, past, mask)
            self._kv = [(layer.keys, layer.values) for layer in self._hf_cache.layers]
        else:
            logits, self._kv = _forward(self.model, ids, positions, self._kv, mask)
        self._mask = mask
        self._lengths = [n + 1 for n in self._lengths]
        return list(logits[:, -1])

    def _prefill(self, fresh: Sequence[tuple[Hashable, Sequence[int]]]) -> dict[Hashable, torch.Tensor]:
        """Prefill ``fresh`` in the forwards :func:`prefill_groups` chooses, each left-padded to its
        longest prefix, then merge the new rows into the padded cache at once."""
        out: dict[Hashable, torch.Tensor] = {}
        groups: list[tuple[list[Hashable], list[int], torch.Tensor, list[KV]]] = []
        for members in prefill_groups([len(p) for _, p in fresh], self.max_padding):
            keys = [fresh[i][0] for i in members]
            lengths = [len(fresh[i][1]) for i in members]
            n = lengths[0]
            pads = torch.tensor([n - m for m in lengths], device=self._device)
            ids = torch.full((len(members), n), self._pad_id, dtype=torch.long, device=self._device)
            for row, i in enumerate(members):
                ids[row, n - lengths[row]:] = torch.tensor(list(fresh[i][1]), dtype=torch.long, device=self._device)
            columns = torch.arange(n, device=self._device)[None, :]
            positions = (columns - pads[:, None]).clamp(min=0)  # padding sits at position 0, masked out
            mask = columns >= pads[:, None]
            logits, kv = _forward(self.model, ids, positions, None, mask if lengths[-1] < n else None)
            out.update((key, logits[row, -1]) for row, key in enumerate(keys))
            groups.append((keys, lengths, mask, kv))
        self._hf_cache = None
        width = max([int(self._mask.shape[1])] + [int(mask.shape[1]) for _, _, mask, _ in groups])
        masks = [_pad_left(self._mask, width, dim=1)] if self._keys else []
        layers: list[list[torch.Tensor]] = [[] for _ in range(2 * len(groups[0][3]))]
        if self._keys:
            for i, (k, v) in enumerate(self._kv):
                layers[2 * i].append(_pad_left(k, width, dim=2))
                layers[2 * i + 1].append(_pad_left(v, width, dim=2))
        for keys, lengths, mask, kv in groups:
            self._keys.extend(keys)
            self._lengths.extend(lengths)
            masks.append(_pad_left(mask, width, dim=1))
            for i, (k, v) in enumerate(kv):
                layers[2 * i].append(_pad_left(k, width, dim=2))
                layers[2 * i + 1].append(_pad_left(v, width, dim=2))
        self._mask = torch.cat(masks, dim=0)
        self._kv = [(torch.cat(layers[2 * i]), torch.cat(layers[2 * i + 1])) for i in range(len(layers) // 2)]
        return out


def prefill_groups(lengths: Sequence[int], max_padding: float) -> list[list[int]]:
    """Indices of the prefixes of ``lengths`` grouped into prefill forwards, longest first.

    Each group is left-padded to its first (longest) prefix. Going down the lengths, a prefix
    joins the current group while the group's padding stays at most ``max_padding`` of its
    positions (rows x longest), else it starts the next group. ``0.0`` batches equal lengths
    only; ``1.0`` prefills everything in one forward.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    padding = 0
    for i in order:
        if groups:
            group = groups[-1]
            width = lengths[group[0]]
            extra = width - lengths[i]
            if padding + extra <= max_padding * width * (len(group) + 1):
                group.append(i)
                padding += extra
                continue
        groups.append([i])
        padding = 0
    return groups


def _pad_left(t: torch.Tensor, width: int, *, dim: int) -> torch.Tensor:
    """Zero-pad ``t`` on the left of ``dim`` to ``width`` (False for a bool mask)."""
    missing = width - int(t.shape[dim])
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([torch.zeros(shape, dtype=t.dtype, device=t.device), t], dim=dim)


def _kind(model: nn.Module) -> str:
    """``tiny``, ``hf`` or ``recompute`` (no cache support: a forward override or another module)."""
    if isinstance(model, TinyPolicy):
        return "tiny" if type(model).forward is TinyPolicy.forward else "recompute"
    if hasattr(model, "config") and hasattr(model, "generation_config"):
        return "hf"
    return "recompute"


def _forward(
    model: nn.Module, ids: torch.Tensor, positions: torch.Tensor, past: list[KV] | None, mask: torch.Tensor | None
) -> tuple[torch.Tensor, list[KV]]:
    """One forward of the family: logits ``[B,T,V]`` (HF: the last position only) and every layer's k/v."""
    if isinstance(model, TinyPolicy):
        return model.forward_cached(ids, positions, past, mask)
    logits, cache = _hf_forward(model, ids, positions, past or None, mask)
    return logits, [(layer.keys, layer.values) for layer in cache.layers]


def _hf_forward(
    model: nn.Module, ids: torch.Tensor, positions: torch.Tensor, past: Any, mask: torch.Tensor | None
) -> tuple[torch.Tensor, Any]:
    """A Hugging Face causal LM's forward with ``past`` (a ``DynamicCache``, k/v pairs or None)."""
    from transformers import DynamicCache  # the tiny family needs no transformers import

    if not isinstance(past, DynamicCache):
        past = DynamicCache(ddp_cache_data=past) if past else DynamicCache()
    # transformers renamed ``past_key_values`` to ``cache`` (5.2x); speak whichever the model takes
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    kwargs: dict[str, Any] = {"input_ids": ids, "position_ids": positions, name: past,
                              "use_cache": True, "logits_to_keep": 1}
    if mask is not None:
        kwargs["attention_mask"] = mask.long()
    result = model(**kwargs)
    return result.logits, getattr(result, name)


def _recompute_last(
    model: nn.Module, prefixes: list[Sequence[int]], pad_id: int, device: torch.device
) -> torch.Tensor:
    """No cache: one right-padded forward over whole prefixes; logits at each last position ``[B, V]``."""
    longest = max(len(p) for p in prefixes)
    ids = torch.full((len(prefixes), longest), pad_id, dtype=torch.long)
    for i, p in enumerate(prefixes):
        ids[i, : len(p)] = torch.tensor(list(p), dtype=torch.long)
    last = torch.tensor([len(p) - 1 for p in prefixes], dtype=torch.long)
    with torch.inference_mode():
        if _kind(model) == "hf":  # right padding: real tokens keep positions 0..n-1; the mask hides the rest
            mask = (torch.arange(longest)[None, :] <= last[:, None]).long()
            logits: torch.Tensor = model(input_ids=ids.to(device), attention_mask=mask.to(device),
                                         use_cache=False).logits
        else:
            logits = model(ids.to(device))
        picked = logits[torch.arange(len(prefixes), device=logits.device), last.to(logits.device)]
    return picked.float().cpu()


def full_logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Logits ``[B,T,V]`` of a full forward with no cache (the reference decoding must equal)."""
    with torch.inference_mode():
        if _kind(model) == "hf":
            hf: torch.Tensor = model(input_ids=ids, use_cache=False).logits
            return hf
        logits: torch.Tensor = model(ids)
        return logits
