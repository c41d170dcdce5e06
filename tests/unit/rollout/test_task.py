"""The number-guessing task: rules, rewards, determinism and the baselines quoted in docs/task.md."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.rollout.task import (
    MAX_TURNS,
    GuessEpisode,
    NumberGuessTask,
    binary_search_policy,
    expected_reward_independent,
    guess_reward,
    optimal_reward,
    parse_guess,
    play,
    random_policy,
    simulate,
)
from shared.tokenizer import TOKENIZER, VOCAB


def _payload(secret: int) -> dict[str, int | str]:
    return {"task": "guess_number", "secret": secret, "low": 0, "high": 15, "max_turns": 5}


@pytest.mark.parametrize(
    ("turns", "found", "reward"),
    [(1, True, 1.0), (2, True, 0.85), (3, True, 0.7), (4, True, 0.55), (5, True, 0.4),
     (5, False, 0.0), (1, False, 0.0)],
)
def test_reward_table(turns: int, found: bool, reward: float) -> None:
    assert guess_reward(turns, found) == pytest.approx(reward)


@pytest.mark.parametrize(
    ("text", "value"),
    [("7", 7), (" 15 ", 15), ("0", 0), ("16", None), ("31", None), ("07", None), ("7 8", None), ("", None),
     ("higher", None), ("-1", None), ("<unk>", None), ("seven", None)],
)
def test_parse_guess(text: str, value: int | None) -> None:
    assert parse_guess(text) == value


def test_feedback_sequence_and_reward() -> None:
    episode = GuessEpisode()
    first = episode.reset(_payload(11))
    assert first == [{"role": "user", "content": "guess the number between 0 and 15"}]
    assert episode.step("7") == [{"role": "user", "content": "higher"}]
    assert episode.step("13") == [{"role": "user", "content": "lower"}]
    assert episode.step("banana") == [{"role": "user", "content": "invalid"}]
    assert episode.reward() == 0.0  # not over yet
    assert episode.step("11") is None
    assert episode.found and episode.turns == 4
    assert episode.reward() == pytest.approx(0.55)
    assert episode.status == "completed"
    with pytest.raises(RuntimeError):
        episode.step("11")


def test_turn_limit_ends_with_zero() -> None:
    episode = GuessEpisode()
    episode.reset(_payload(3))
    answers = [episode.step("9") for _ in range(MAX_TURNS)]
    assert answers[:-1] == [[{"role": "user", "content": "lower"}]] * (MAX_TURNS - 1)
    assert answers[-1] is None
    assert episode.reward() == 0.0 and episode.turns == MAX_TURNS and not episode.found


def test_invalid_answers_cost_turns() -> None:
    episode = GuessEpisode()
    episode.reset(_payload(0))
    for _ in range(MAX_TURNS - 1):
        assert episode.step("16") == [{"role": "user", "content": "invalid"}]
    assert episode.step("0") is None
    assert episode.reward() == pytest.approx(0.4)


@pytest.mark.parametrize(
    "payload", [{}, {"secret": 16}, {"secret": -1}, {"secret": "x"}, {"secret": 3, "max_turns": 0}]
)
def test_bad_payload_is_refused(payload: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        GuessEpisode().reset(payload)


def test_every_word_the_model_sees_is_in_the_vocabulary() -> None:
    episode = GuessEpisode()
    texts = [m["content"] for m in episode.reset(_payload(5))]
    texts += ["higher", "lower", "invalid", "correct"]
    for text in texts:
        assert TOKENIZER.unk_id not in TOKENIZER.encode(text), text
    assert all(str(n) in VOCAB for n in range(16))


def test_prompts_are_deterministic_and_balanced() -> None:
    task = NumberGuessTask()
    a = list(itertools.islice(task.prompts(7), 64))
    b = list(itertools.islice(task.prompts(7), 64))
    c = list(itertools.islice(task.prompts(8), 64))
    assert a == b
    assert [p.payload["secret"] for p in a] != [p.payload["secret"] for p in c]
    assert len({p.prompt_id for p in a}) == 64
    for block in range(4):
        assert sorted(p.payload["secret"] for p in a[16 * block : 16 * (block + 1)]) == list(range(16))


def test_binary_search_is_optimal_and_matches_learning_notes() -> None:
    assert optimal_reward() == pytest.approx(0.64375)
    task = NumberGuessTask()
    for secret in range(16):
        reward, messages = play(task, _payload(secret), binary_search_policy)
        assert reward > 0, (secret, messages)


@given(st.lists(st.integers(min_value=0, max_value=15), min_size=5, max_size=5, unique=True))
def test_no_feedback_ignoring_sequence_beats_0_219(guesses: list[int]) -> None:
    """Any fixed 5-guess sequence averages at most (1+.85+.7+.55+.4)/16 = 0.21875 over secrets."""
    task = NumberGuessTask()
    total = 0.0
    for secret in range(16):
        moves = iter(str(g) for g in guesses)
        total += play(task, _payload(secret), lambda _m, moves=moves: next(moves))[0]
    assert total / 16 == pytest.approx(0.21875)


def test_random_baselines() -> None:
    # Uniform over the 32 number tokens (the learning notes' random policy): exact 0.104, notes say 0.105.
    assert expected_reward_independent(1 / 32) == pytest.approx(0.1041, abs=1e-4)
    # Uniform over the 16 valid numbers: 0.198.
    assert expected_reward_independent(1 / 16) == pytest.approx(0.1984, abs=1e-4)
    task = NumberGuessTask()
    simulated = simulate(task, random_policy(random.Random(0), [str(n) for n in range(32)]), 4000, seed=1)
    assert simulated == pytest.approx(expected_reward_independent(1 / 32), abs=0.02)
    assert round(simulated, 3) == 0.104  # the figure docs/task.md quotes


def _hit_rate(max_tokens: int, secret: int = 7) -> float:
    """Chance that a policy uniform over the whole vocabulary replies exactly ``secret`` within
    ``max_tokens`` sampled ids (it stops at the end id; special ids are not text, as the agent reads it)."""
    n, hits = TOKENIZER.vocab_size, 0
    for ids in itertools.product(range(n), repeat=max_tokens):
        stop = next((i for i, t in enumerate(ids) if t == TOKENIZER.end_id), len(ids) - 1)
        hits += parse_guess(TOKENIZER.decode(ids[: stop + 1])) == secret
    return hits / n**max_tokens


def test_one_token_reply_figures() -> None:
    """docs/task.md's untrained-policy row and its case for one-token replies, from the tokenizer itself."""
    assert TOKENIZER.vocab_size == 54
    one, two = _hit_rate(1), _hit_rate(2)
    assert one == pytest.approx(1 / 54) and round(one, 3) == 0.019
    assert round(two, 3) == 0.004  # "N" then a special id, or a special id then "N": 11 of 54 * 54
    assert round(expected_reward_independent(one), 3) == 0.063
    assert round(expected_reward_independent(two), 3) == 0.013

    def any_success(hit: float, group: int = 8) -> float:
        return 1 - (1 - hit) ** (group * MAX_TURNS)

    assert round(any_success(one), 2) == 0.53 and round(any_success(two), 2) == 0.14
