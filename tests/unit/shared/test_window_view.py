"""The window's view of a completed group (``shared/window_view.py``): whether its failure is charged to
the prompt (not when any session ended for a dependency's fault), whether its rewards carry a signal, and
how many trainable tokens it holds, which is what its drop leaves untrained."""

from __future__ import annotations

from shared.errors import UNCHARGED_ERRORS


def test_uncharged_is_computed_from_every_abnormal_session() -> None:
    from shared.schemas import CompletedGroup, Trajectory
    from shared.window_view import window_group

    def group(*ends: tuple[str, str]) -> CompletedGroup:
        trajs = [Trajectory(session_id=f"s{i}", status=s, error=e, segments=[]) for i, (s, e) in enumerate(ends)]  # type: ignore[arg-type]
        return CompletedGroup(group_id="g", prompt_id="p", failed=True, trajectories=trajs)

    free = group(("completed", ""), ("rejected", "incomplete"), ("failed", "engine_unavailable"))
    assert window_group(free).uncharged
    assert window_group(group(("rejected", "engine_lost"), ("completed", ""))).uncharged  # an engine died
    charged = group(("rejected", "session_idle"), ("rejected", "partial_rollout_staleness_exceeded"))
    assert not window_group(charged).uncharged
    assert not window_group(group(("failed", ""))).uncharged  # no reason given: the prompt pays
    assert {"session_idle", "incomplete", "session_lost", "engine_unavailable", "timeout"} <= UNCHARGED_ERRORS


def test_window_group_signal_comes_from_the_rewards() -> None:
    from shared.schemas import CompletedGroup, Trajectory
    from shared.window_view import window_group

    def group(*rewards: float) -> CompletedGroup:
        trajs = [
            Trajectory(session_id=f"s{i}", status="completed", reward=r, segments=[]) for i, r in enumerate(rewards)
        ]
        return CompletedGroup(group_id="g", prompt_id="p", failed=False, trajectories=trajs)

    assert window_group(group(1.0, 0.0, 1.0)).signal
    assert not window_group(group(0.5, 0.5, 0.5)).signal
    assert not window_group(group(1.0)).signal


def test_window_group_counts_the_trainable_tokens_it_holds() -> None:
    from shared.schemas import CompletedGroup, Segment, Trajectory
    from shared.window_view import window_group

    def seg(index: int, mask: list[int]) -> Segment:
        return Segment(segment_index=index, token_ids=[0] * len(mask), loss_mask=mask, logprobs=[0.0] * len(mask),
                       versions=["v1" if m else None for m in mask])

    trajs = [
        Trajectory(session_id="s0", status="completed", reward=1.0, segments=[seg(0, [0, 0, 1, 1]), seg(1, [0, 1])]),
        Trajectory(session_id="s1", status="rejected", error="session_idle", segments=[seg(0, [0, 1, 1, 1])]),
        Trajectory(session_id="s2", status="rejected", error="session_lost", segments=[]),
    ]
    group = CompletedGroup(group_id="g", prompt_id="p", failed=True, trajectories=trajs)
    assert window_group(group).tokens == 3 + 3
