"""The proxy's engine table: least loaded healthy engine for a new session, sticky for its lifetime,
lost (never moved) once it holds tokens of an engine that went away."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.proxy.routing import EngineTable
from shared.errors import EngineLost, EngineUnavailable

A, B, C = "http://a:1", "http://b:1", "http://c:1"


def start(table: EngineTable, session_id: str) -> str:
    url = table.route(session_id, "", holds_tokens=False)
    table.stick(url)
    return url


def test_new_sessions_go_to_the_least_loaded_engine() -> None:
    table = EngineTable([A, B, C])
    first = [start(table, f"s{i}") for i in range(3)]
    assert sorted(first) == [A, B, C], "three sessions, three engines"
    table.unstick(B)
    assert start(table, "s3") == B, "the engine a session left has the fewest"
    assert {table.entries[u].sessions for u in (A, B, C)} == {1}


def test_a_session_sticks_to_its_engine_while_others_are_less_loaded() -> None:
    table = EngineTable([A, B])
    url = start(table, "s")
    for i in range(5):
        table.stick(url)  # others pile onto the same engine
        assert table.route("s", url, holds_tokens=True) == url, i


def test_an_engine_turns_unhealthy_after_the_failures_in_a_row_and_back_after_one_answer() -> None:
    table = EngineTable([A, B], unhealthy_after=2)
    assert not table.checked(A, ok=False), "one failure is not enough"
    assert table.checked(A, ok=True) is False and table.entries[A].failures == 0, "an answer resets the count"
    assert not table.checked(A, ok=False)
    assert table.checked(A, ok=False), "the second in a row takes it out"
    assert table.routable() == [B]
    assert not table.checked(A, ok=False), "still out"
    assert table.checked(A, ok=True) and table.routable() == [A, B]


def test_a_session_holding_tokens_of_a_lost_engine_is_lost_and_one_without_moves() -> None:
    table = EngineTable([A, B], unhealthy_after=1)
    url = start(table, "s")
    table.checked(url, ok=False)
    with pytest.raises(EngineLost) as lost:
        table.route("s", url, holds_tokens=True)
    assert lost.value.fields["engine"] == url and "health" in lost.value.message
    other = table.route("s", url, holds_tokens=False)
    assert other != url, "nothing of the session is there: it starts on the healthy engine"


def test_no_engine_at_all_is_unavailable_not_lost() -> None:
    table = EngineTable([A], unhealthy_after=1)
    table.checked(A, ok=False)
    with pytest.raises(EngineUnavailable) as err:
        table.route("s", "", holds_tokens=False)
    assert not isinstance(err.value, EngineLost) and "no healthy engine" in err.value.message
    with pytest.raises(EngineUnavailable):
        EngineTable([]).route("s", "", holds_tokens=False)


def test_registered_engines_join_once_they_answered_and_leave_with_their_registration() -> None:
    table = EngineTable([A])
    assert table.registered([B, C]) == ([B, C], []), "new: to be asked first"
    assert table.routable() == [A], "not before they answered"
    table.joined(B)
    assert table.registered([B, C]) == ([C], []), "B is in; C still has to answer"
    assert table.routable() == [A, B]
    url = table.route("s", "", holds_tokens=False)
    table.stick(url)
    table.route("t", "", holds_tokens=False)
    assert table.registered([C]) == ([C], [B]) and table.routable() == [A], "B's registration lapsed"
    if url == B:
        with pytest.raises(EngineLost, match="left the registry"):
            table.route("s", B, holds_tokens=True)
    assert table.registered([B]) == ([B], []), "back: it must answer again before it gets sessions"
    assert table.routable() == [A]


def test_a_fixed_engine_never_leaves_and_starts_healthy() -> None:
    table = EngineTable([A])
    assert table.registered([]) == ([], []) and table.routable() == [A]
    table.joined(A)  # a fixed engine that also registers stays fixed
    assert table.registered([]) == ([], []) and table.routable() == [A]


def test_unhealthy_after_must_be_positive() -> None:
    with pytest.raises(ValueError, match="unhealthy_after"):
        EngineTable([A], unhealthy_after=0)


events = st.lists(st.one_of(
    st.tuples(st.just("start"), st.integers(0, 30)),
    st.tuples(st.just("end"), st.integers(0, 30)),
    st.tuples(st.just("check"), st.sampled_from([A, B, C]), st.booleans()),
    st.tuples(st.just("register"), st.sets(st.sampled_from([B, C]))),
    st.tuples(st.just("join"), st.sampled_from([B, C])),
), max_size=80)


@settings(max_examples=300, deadline=None)
@given(events)
def test_routing_properties(script: list[tuple[object, ...]]) -> None:
    """Whatever the engines do: a call goes to a routable engine; a session holding tokens never changes
    engine (it is lost instead, only when its engine is not routable); the loads count the live sessions;
    a new session's engine is a least loaded routable one."""
    table = EngineTable([A], unhealthy_after=2)
    live: dict[str, str] = {}
    for event in script:
        kind = event[0]
        if kind == "start":
            sid = f"s{event[1]}"
            current = live.get(sid, "")
            try:
                url = table.route(sid, current, holds_tokens=bool(current))
            except EngineLost:
                assert current and current not in table.routable()
                table.unstick(current)
                del live[sid]
                continue
            except EngineUnavailable:
                assert table.routable() == [] and not current
                continue
            assert url in table.routable()
            if current:
                assert url == current, "a session holding tokens never moves"
            else:
                loads = {u: table.entries[u].sessions for u in table.routable()}
                assert loads[url] == min(loads.values())
                table.stick(url)
                live[sid] = url
        elif kind == "end":
            sid = f"s{event[1]}"
            if sid in live:
                table.unstick(live.pop(sid))
        elif kind == "check":
            table.checked(str(event[1]), ok=bool(event[2]))
        elif kind == "register":
            table.registered(set(event[1]))  # type: ignore[arg-type]
        else:
            table.joined(str(event[1]))
        for url, entry in table.entries.items():
            assert entry.sessions == sum(1 for u in live.values() if u == url)
