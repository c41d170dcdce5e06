"""A tiny policy that already keeps number guessing's format: a warm start (``REIN_INIT_WEIGHTS``) for the
scenarios that need optimizer steps, not learning.

Untrained, the tiny policy's multi-token replies almost never read as the secret, so nearly every group's
rewards are equal and most batches carry no gradient: the closed loop once took 99 to 198 batches for its 5
optimizer steps, a wait set by luck. Fitted for a moment to uniformly random valid guesses (one number,
then the end of the turn), it plays episodes that score anywhere from 0 to 1, so almost every batch trains.
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import torch
import torch.nn.functional as F

from services.rollout.task import NumberGuessTask, play, random_policy
from shared.model import load_family
from shared.model.base import ChatTokenizer
from shared.tokenizer import TOKENIZER


def _examples(template: ChatTokenizer, seed: int, games: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids up to the assistant header, the reply's ids: one number and the end) of every assistant
    turn of ``games`` games played by random valid guesses."""
    task, rng = NumberGuessTask(), random.Random(seed)
    out = []
    for prompt in itertools.islice(task.prompts(seed), games):
        _, messages = play(task, dict(prompt.payload), random_policy(rng, [str(n) for n in range(16)]))
        for i, message in enumerate(messages):
            if message["role"] == "assistant":
                ids = template.encode_chat(messages[:i], add_generation_prompt=True)
                out.append((ids, [TOKENIZER.token_id(str(message["content"])), TOKENIZER.end_id]))
    return out


def format_keeping_checkpoint(path: Path, seed: int = 0, games: int = 16, steps: int = 60) -> Path:
    """Write to ``path`` (a trainer's checkpoint file, version ``v0``) the tiny policy of ``seed`` fitted by
    cross-entropy to reply one valid number and end its turn; a few CPU-seconds, on one torch thread (the
    caller's test worker shares the cores with others, where a second thread only spins)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _fit(path, seed, games, steps)
    finally:
        torch.set_num_threads(threads)


def _fit(path: Path, seed: int, games: int, steps: int) -> Path:
    torch.manual_seed(seed)
    family = load_family("tiny")
    model = family.new_model(seed, torch.device("cpu"))
    model.train()
    examples = _examples(family.tokenizer, seed, games)
    width = max(len(p) + len(r) for p, r in examples)
    ids = torch.full((len(examples), width), TOKENIZER.pad_id, dtype=torch.long)
    targets = torch.full((len(examples), width), -100, dtype=torch.long)
    for row, (prompt, reply) in enumerate(examples):
        ids[row, : len(prompt) + len(reply)] = torch.tensor(prompt + reply)
        # position t predicts token t+1: the last prompt position predicts the number, the number the end
        targets[row, len(prompt) - 1 : len(prompt) + len(reply) - 1] = torch.tensor(reply)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        loss = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten(), ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
    model.eval()
    family.save(model, path, version="v0", step=0)
    return path
