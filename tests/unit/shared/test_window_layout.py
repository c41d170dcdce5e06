from __future__ import annotations

from shared.staleness import TokenTally, WindowState
from shared.window_layout import decode_window, encode_window


def test_window_hash_round_trips_the_token_tally() -> None:
    state = WindowState(current="v3", batches=2, drops_total=4, tokens=TokenTally(100, 20, 7, 5))
    raw = {k: str(v) for k, v in encode_window(state, steps=9).items()}
    assert raw["tokens_generated"] == "100" and raw["untrained:window"] == "20"
    hashed = decode_window(raw)
    assert hashed.tokens == TokenTally(generated=100, window=20, no_signal=7, failed=5)
    assert (hashed.current, hashed.batches, hashed.steps, hashed.drops_total) == ("v3", 2, 9, 4)


def test_a_hash_written_before_tokens_were_counted_reads_zero() -> None:
    hashed = decode_window({"current": "v1", "batches": "1", "drops_total": "2", "drops:dropped_stale": "2"})
    assert hashed.tokens == TokenTally()
    assert hashed.drops_by_reason == {"dropped_stale": 2}
