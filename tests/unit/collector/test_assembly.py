"""Assembly of chunks and events into completed groups, and which records it says are done."""

from __future__ import annotations

from services.collector.assembly import (
    CONFLICTING_CHUNKS,
    PARTIAL_ROLLOUT_STALENESS,
    Assembler,
    Position,
    RecentSpans,
    SeenOnce,
    partial_rollout_rejected_samples,
    trajectory_version_span,
    version_spans,
)
from shared.offsets import Offsets
from shared.schemas import (
    Chunk,
    CompletedGroup,
    Record,
    SamplingParams,
    Segment,
    SessionRejected,
    Trajectory,
)
from shared.window_view import window_group
from tests.support.rollout_records import CHUNKS, EVENTS, chunk, commits, dispatched, finished


class Feed:
    """Feeds records with increasing offsets per topic (partition 0), through the consumer's offsets."""

    def __init__(self) -> None:
        self.asm = Assembler()
        self.offsets = Offsets()
        self.next = {CHUNKS: 0, EVENTS: 0}
        self.completed: list[CompletedGroup] = []

    def commits(self) -> dict[tuple[str, int], int]:
        return commits(self.asm, self.offsets)

    def deliver(self, pos: Position, record: Record, now: float = 0.0) -> CompletedGroup | None:
        if not self.offsets.deliver(pos.tp, pos.offset):
            return None
        return self.asm.add(pos, record, now)

    def __call__(self, record: Record, offset: int | None = None) -> CompletedGroup | None:
        topic = CHUNKS if isinstance(record, Chunk) else EVENTS
        if offset is None:
            offset = self.next[topic]
            self.next[topic] += 1
        out = self.deliver(Position(topic, 0, offset), record)
        if out is not None:
            self.completed.append(out)
        return out


def test_group_completes_only_when_every_session_ended_and_all_chunks_arrived() -> None:
    feed = Feed()
    assert feed(dispatched(["s1", "s2"])) is None
    assert feed(chunk("s1", 0)) is None
    assert feed(finished("s1", 2)) is None  # s1 needs two chunks
    assert feed(chunk("s1", 1, ctx=[3])) is None
    assert feed(chunk("s2", 0)) is None
    group = feed(finished("s2", 1, reward=0.0))
    assert group is not None
    assert group.group_id == "g1" and group.prompt_id == "p1" and not group.failed
    assert [t.session_id for t in group.trajectories] == ["s1", "s2"]
    seg = group.trajectories[0].segments[0]
    assert seg.token_ids == [1, 2, 10, 20, 3, 11, 21]
    assert seg.loss_mask == [0, 0, 1, 1, 0, 1, 1]
    assert seg.logprobs == [0.0, 0.0, -0.5, -0.5, 0.0, -0.5, -0.5]
    assert seg.versions == [None, None, "v1", "v1", None, "v1", "v1"]
    assert group.trajectories[1].reward == 0.0
    assert group.prompt == {"q": 1}


def test_events_before_chunks_and_dispatch_last() -> None:
    feed = Feed()
    feed(finished("s1", 2))
    feed(chunk("s1", 1))
    feed(chunk("s1", 0))
    assert feed.completed == []  # not dispatched yet
    group = feed(dispatched(["s1"]))
    assert group is not None
    assert group.trajectories[0].segments[0].token_ids == [1, 2, 10, 20, 1, 2, 11, 21]  # seq order, not arrival


def test_duplicates_are_ignored_and_the_group_is_emitted_once() -> None:
    feed = Feed()
    feed(dispatched(["s1"]))
    feed(chunk("s1", 0))
    feed(chunk("s1", 0))  # the same record again (a replay): ignored
    feed(dispatched(["s1", "other"]))  # duplicate dispatch: first one wins
    group = feed(finished("s1", 1))
    assert group is not None
    assert group.trajectories[0].segments[0].token_ids == [1, 2, 10, 20]
    assert feed(chunk("s1", 0)) is None
    assert feed(finished("s1", 1)) is None
    assert len(feed.completed) == 1


def test_rejected_session_makes_a_failed_group_and_failed_status_too() -> None:
    feed = Feed()
    feed(dispatched(["s1", "s2"]))
    feed(chunk("s1", 0))
    feed(finished("s1", 1))
    group = feed(
        SessionRejected(session_id="s2", group_id="g1", error="partial_rollout_staleness_exceeded", num_chunks=0)
    )
    assert group is not None and group.failed
    assert group.trajectories[1].status == "rejected"
    assert group.trajectories[1].error == "partial_rollout_staleness_exceeded"
    assert group.trajectories[1].segments == []

    feed2 = Feed()
    feed2(dispatched(["s1"], gid="g2"))
    group2 = feed2(finished("s1", 0, gid="g2", status="failed"))
    assert group2 is not None and group2.failed


def test_a_lost_session_ends_without_its_chunks_and_the_first_end_wins() -> None:
    feed = Feed()
    feed(dispatched(["s1", "s2"]))
    feed(chunk("s1", 0))
    feed(finished("s1", 1))
    feed(chunk("s2", 0))
    # s2's proxy died after publishing chunk 1 of an unknown number: the runner ends it, count unknown
    group = feed(SessionRejected(session_id="s2", group_id="g1", error="session_lost", num_chunks=None))
    assert group is not None and group.failed
    lost = group.trajectories[1]
    assert (lost.status, lost.error) == ("rejected", "session_lost")
    assert lost.segments[0].token_ids == [1, 2, 10, 20]  # what had arrived, in seq order
    assert feed(chunk("s2", 1)) is None  # late chunks of a decided group are duplicates
    assert feed(finished("s2", 2)) is None
    assert len(feed.completed) == 1

    # The proxy's own end came first: the runner's later one changes nothing.
    feed2 = Feed()
    feed2(dispatched(["s1"], gid="g2"))
    feed2(chunk("s1", 0, gid="g2"))
    feed2(SessionRejected(session_id="s1", group_id="g2", error="trajectory_version_changed", num_chunks=2))
    assert feed2.completed == []  # still waits for chunk 1
    feed2(SessionRejected(session_id="s1", group_id="g2", error="session_lost", num_chunks=None))
    assert feed2.completed == []
    group2 = feed2(chunk("s1", 1, gid="g2"))
    assert group2 is not None and group2.trajectories[0].error == "trajectory_version_changed"


def test_segments_are_split_and_the_highest_segment_decides_the_window_version() -> None:
    feed = Feed()
    feed(dispatched(["s1"]))
    feed(chunk("s1", 0, seg=0, version="v1"))
    feed(chunk("s1", 1, seg=0, ctx=[], version="v2"))  # resumed after a preempt: same segment, new version
    feed(chunk("s1", 2, seg=1, version="v1"))  # next segment ends on v1
    group = feed(finished("s1", 3))
    assert group is not None
    segs = group.trajectories[0].segments
    assert [s.segment_index for s in segs] == [0, 1]
    assert segs[0].versions == [None, None, "v1", "v1", "v2", "v2"]
    assert segs[0].finish_reason == "stop"
    assert window_group(group).versions == ("v1",)


def test_unversioned_trajectories_are_ignored_by_the_window() -> None:
    feed = Feed()
    feed(dispatched(["s1", "s2"]))
    feed(chunk("s1", 0, version=None))
    feed(chunk("s2", 0, version="v3"))
    feed(finished("s1", 1))
    group = feed(finished("s2", 1))
    assert group is not None
    assert window_group(group).versions == ("v3",)


def test_offsets_of_incomplete_groups_hold_the_commit_until_release() -> None:
    feed = Feed()
    feed(dispatched(["a1"], gid="A"))  # events@0
    feed(dispatched(["b1"], gid="B"))  # events@1
    feed(chunk("a1", 0, gid="A"))  # chunks@0
    feed(chunk("b1", 0, gid="B"))  # chunks@1
    group = feed(finished("a1", 1, gid="A"))  # events@2
    assert group is not None
    # A complete but not yet released: everything still held
    assert feed.commits() == {(CHUNKS, 0): 0, (EVENTS, 0): 0}
    feed.asm.release("A")
    assert feed.commits() == {(CHUNKS, 0): 1, (EVENTS, 0): 1}
    feed.offsets.deliver((EVENTS, 0), 3)  # a malformed record after everything: the consumer marks it done
    feed.offsets.done((EVENTS, 0), 3)
    feed.next[EVENTS] = 4
    assert feed.commits() == {(CHUNKS, 0): 1, (EVENTS, 0): 1}
    assert feed(finished("b1", 1, gid="B")) is not None  # events@4
    feed.asm.release("B")
    assert feed.commits() == {(CHUNKS, 0): 2, (EVENTS, 0): 5}
    # a record of a released group published again (a new offset) is done at once
    feed(chunk("a1", 0, gid="A"), offset=2)
    assert feed.commits() == {(CHUNKS, 0): 3, (EVENTS, 0): 5}
    # one delivered again at an offset already read (a rebalance) is not folded at all
    assert feed(dispatched(["b1"], gid="B"), offset=1) is None
    assert feed.asm.assembling == 0


def test_marked_done_groups_and_revoked_partitions() -> None:
    feed = Feed()
    feed.asm.mark_done("old")
    assert feed(chunk("x", 0, gid="old")) is None
    assert feed.asm.assembling == 0
    feed(chunk("y", 0, gid="new"))
    assert feed.asm.assembling == 1
    assert feed.asm.forget_partitions([(CHUNKS, 0)]) == ["new"]
    feed.offsets.revoke([(CHUNKS, 0)])
    assert feed.asm.assembling == 0
    assert (CHUNKS, 0) not in feed.commits()


def test_per_token_versions_reach_the_segment_and_the_window_view() -> None:
    """A chunk whose engine swapped weights mid-request: each token keeps its own version, and the
    group's window version is the one of its last trainable token."""
    feed = Feed()
    feed(dispatched(["s1"]))
    mixed = chunk("s1", 0, out=[7, 8, 9], version="v2")
    mixed = mixed.model_copy(update={"token_versions": [("v1", 2), ("v2", 1)]})
    feed(mixed)
    group = feed(finished("s1", 1))
    assert group is not None
    [segment] = group.trajectories[0].segments
    assert segment.versions == [None, None, "v1", "v1", "v2"]
    assert window_group(group).versions == ("v2",)


def test_each_chunks_sampling_parameters_reach_its_tokens() -> None:
    """Two calls of one session at different temperatures (and a chunk that recorded none): every
    output token keeps its own chunk's parameters, context tokens have none."""
    feed = Feed()
    feed(dispatched(["s1"]))
    hot, cool = SamplingParams(temperature=1.2), SamplingParams(temperature=0.7, top_p=0.9)
    feed(chunk("s1", 0, out=[7, 8]).model_copy(update={"sampling": hot}))
    feed(chunk("s1", 1, out=[9]).model_copy(update={"sampling": cool}))
    feed(chunk("s1", 2, ctx=[], out=[4]))
    group = feed(finished("s1", 3))
    assert group is not None
    [segment] = group.trajectories[0].segments
    assert segment.token_sampling() == [None, None, hot, hot, None, None, cool, None]
    assert segment.sampling == [(None, 2), (hot, 2), (None, 2), (cool, 1), (None, 1)]


def test_a_session_without_recorded_sampling_has_no_runs() -> None:
    feed = Feed()
    feed(dispatched(["s1"]))
    feed(chunk("s1", 0))
    group = feed(finished("s1", 1))
    assert group is not None and group.trajectories[0].segments[0].sampling == []


def _traj(versions: list[str | None], status: str = "completed", error: str = "") -> Trajectory:
    n = len(versions)
    seg = Segment(segment_index=0, token_ids=list(range(n)), loss_mask=[1] * n, logprobs=[0.0] * n, versions=versions)
    return Trajectory(session_id="s", status=status, error=error, segments=[seg])  # type: ignore[arg-type]


def _completed(trajectories: list[Trajectory], failed: bool) -> CompletedGroup:
    return CompletedGroup(group_id="g", prompt_id="p", failed=failed, trajectories=trajectories)


def test_span_counts_distinct_real_versions_over_all_tokens() -> None:
    assert trajectory_version_span(_traj([None, "v0", "v0", None, "v1", " v1 ", "unknown", "-1"])) == 2
    assert trajectory_version_span(_traj([None, None])) == 0
    ok = _completed([_traj(["v0"]), _traj(["v0", "v1", "v2"]), _traj([None])], failed=False)
    assert version_spans(ok) == [1, 3]  # a trajectory without a real version gives no span
    assert version_spans(ok.model_copy(update={"failed": True})) == []


def test_partial_rollout_rejections_count_the_whole_group() -> None:
    hit = _traj(["v0"], "rejected", PARTIAL_ROLLOUT_STALENESS)
    assert partial_rollout_rejected_samples(_completed([hit, _traj(["v0"]), _traj(["v0"])], failed=True)) == 3
    other = _traj(["v0"], "rejected", "generation_preempted")
    assert partial_rollout_rejected_samples(_completed([other, _traj(["v0"])], failed=True)) == 0


def test_recent_spans_and_seen_once() -> None:
    spans = RecentSpans(size=3)
    assert spans.stats() is None
    spans.add([5, 1, 2])
    spans.add([3])  # 5 falls out
    stats = spans.stats()
    assert stats is not None and (stats.min, stats.max, stats.mean) == (1, 3, 2.0)
    seen = SeenOnce(size=2)
    assert [seen.add(k) for k in ("a", "a", "b", "c", "a")] == [True, False, True, True, True]


def test_a_session_two_proxies_served_is_rejected_not_stitched() -> None:
    """Its first call answered by one proxy, the rest (retried or moved) by another that started the session
    afresh: two different chunks claim seq 0. Whichever arrives first, no trajectory mixes the two streams."""
    for first, second in ((chunk("s1", 0, out=[7]), chunk("s1", 0)), (chunk("s1", 0), chunk("s1", 0, out=[7]))):
        feed = Feed()
        feed(dispatched(["s1", "s2"]))
        feed(first)
        feed(second)
        feed(chunk("s1", 1))
        feed(chunk("s2", 0))
        feed(finished("s2", 1))
        group = feed(finished("s1", 2))
        assert group is not None and group.failed
        s1, s2 = group.trajectories
        assert (s1.status, s1.error, s1.segments) == ("rejected", CONFLICTING_CHUNKS, [])
        assert s2.status == "completed" and s2.segments
