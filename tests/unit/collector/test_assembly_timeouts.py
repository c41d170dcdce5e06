"""Groups the collector's assembler gives up on after a silence: never dispatched, dropped; dispatched,
failed with every session that did not end whole rejected as incomplete, so the prompt is retried; the
silence counted from the end of an outage, not from before it; and the records held until then."""

from __future__ import annotations

from services.collector.assembly import Assembler, Position
from shared.offsets import Offsets
from shared.schemas import Record
from tests.support.rollout_records import CHUNKS, EVENTS, chunk, commits, dispatched, finished


def test_expire_drops_silent_groups_that_were_never_dispatched() -> None:
    asm, offsets = Assembler(), Offsets()
    offsets.deliver((CHUNKS, 0), 0)
    asm.add(Position(CHUNKS, 0, 0), chunk("s", 0, gid="G"), now=100.0)
    assert asm.expire(now=150.0, timeout_s=60.0).dropped == []
    expired = asm.expire(now=161.0, timeout_s=60.0)
    assert expired.dropped == ["G"] and expired.failed == []
    assert commits(asm, offsets) == {(CHUNKS, 0): 1}
    assert asm.add(Position(EVENTS, 0, 0), dispatched(["s"], gid="G"), now=170.0) is None  # done: a duplicate


def test_touch_restarts_the_timeout_after_an_outage() -> None:
    asm = Assembler()
    asm.add(Position(EVENTS, 0, 0), dispatched(["s"], gid="G"), now=100.0)
    asm.touch(150.0)  # the shell could not read between 100 and 150
    assert asm.expire(now=200.0, timeout_s=60.0).failed == []
    assert [g.group_id for g in asm.expire(now=211.0, timeout_s=60.0).failed] == ["G"]


def test_expire_fails_a_silent_dispatched_group_so_its_prompt_is_retried() -> None:
    """A session the proxy never saw (its agent died first), one with a hole in its chunks, and one
    whose chunks stopped without an end are rejected as incomplete; a whole session stays as it ended."""
    asm, offsets = Assembler(), Offsets()
    records: list[tuple[str, Record]] = [
        (EVENTS, dispatched(["whole", "holed", "silent", "unseen"])),
        (CHUNKS, chunk("whole", 0)),
        (EVENTS, finished("whole", 1, reward=1.0)),
        (CHUNKS, chunk("holed", 0)),
        (CHUNKS, chunk("holed", 2)),
        (EVENTS, finished("holed", 3)),
        (CHUNKS, chunk("silent", 0)),
    ]
    next_offset = {CHUNKS: 0, EVENTS: 0}
    for topic, record in records:
        pos = Position(topic, 0, next_offset[topic])
        assert offsets.deliver(pos.tp, pos.offset)
        assert asm.add(pos, record, now=100.0) is None
        next_offset[topic] += 1
    assert asm.expire(now=130.0, timeout_s=60.0).failed == []
    expired = asm.expire(now=161.0, timeout_s=60.0)
    assert expired.dropped == []
    [group] = expired.failed
    assert group.failed and group.prompt_id == "p1"
    by_id = {t.session_id: t for t in group.trajectories}
    assert [t.session_id for t in group.trajectories] == ["whole", "holed", "silent", "unseen"]
    assert by_id["whole"].status == "completed" and by_id["whole"].reward == 1.0
    for sid, segments in (("holed", 1), ("silent", 1), ("unseen", 0)):
        assert (by_id[sid].status, by_id[sid].error) == ("rejected", "incomplete")
        assert len(by_id[sid].segments) == segments  # the contiguous chunks from seq 0
    assert asm.expire(now=500.0, timeout_s=60.0).failed == []  # emitted once
    assert commits(asm, offsets) == {(CHUNKS, 0): 0, (EVENTS, 0): 0}  # held until the shell decided and released it
    asm.release(group.group_id)
    assert commits(asm, offsets) == {(CHUNKS, 0): 4, (EVENTS, 0): 3}
    assert asm.add(Position(EVENTS, 0, 3), finished("silent", 1), now=600.0) is None  # a late end is a duplicate
