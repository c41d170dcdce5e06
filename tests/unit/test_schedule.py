"""The parallel run's scheduler (tests/support/schedule.py) driven by simulated xdist workers.

A simulated worker behaves as xdist's does: it starts a test only once it knows the next one or has
been told that none will come (``pytest_runtestloop`` in ``xdist/remote.py``).
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace

from tests.support.schedule import (
    COMPOSE,
    LONG_FIRST,
    STACKS,
    STACKS_B,
    STACKS_B_MODULES,
    ModulesHeavyFirst,
    order,
    unit_of,
)

COLLECTION = [
    COMPOSE + "::test_whole",
    "tests/e2e/test_a.py::test_1",
    "tests/e2e/test_b.py::test_1",
    "tests/integration/test_i.py::test_1",
    "tests/integration/test_i.py::test_2",
    "tests/unit/test_u1.py::test_1",
    "tests/unit/test_u2.py::test_1",
    "tests/unit/test_u3.py::test_1",
]


class Worker:
    """A worker's queue of item indices, as xdist keeps it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.queue: list[int] = []
        self.shutting_down = False
        self.gateway = SimpleNamespace(id=name)

    def send_runtest_some(self, indices: list[int]) -> None:
        self.queue.extend(indices)

    def shutdown(self) -> None:
        self.shutting_down = True

    def can_start(self) -> bool:
        """The head of the queue runs only once a next item is queued or shutdown was sent."""
        return bool(self.queue) and (len(self.queue) >= 2 or self.shutting_down)


def scheduler(workers: list[Worker]) -> ModulesHeavyFirst:
    """The scheduler after xdist's initial distribution of :data:`COLLECTION` (in :func:`order`) to ``workers``."""
    sched = ModulesHeavyFirst.__new__(ModulesHeavyFirst)  # xdist builds it from its config; only these are read
    sched.numnodes = len(workers)
    sched.collection = None
    sched.workqueue = OrderedDict()
    sched.assigned_work = {}
    sched.registered_collections = {}
    sched.log = lambda *args: None
    sched.config = SimpleNamespace(option=SimpleNamespace(loadscopereorder=False))
    collection = [item.nodeid for item in order([SimpleNamespace(nodeid=n) for n in COLLECTION])]  # type: ignore[misc]
    for w in workers:
        sched.add_node(w)
        sched.add_node_collection(w, collection)
    sched.schedule()
    return sched


def units(sched: ModulesHeavyFirst, w: Worker) -> list[str]:
    assert sched.collection is not None
    return [unit_of(sched.collection[i]) for i in w.queue]


def run(sched: ModulesHeavyFirst, w: Worker) -> str:
    """``w`` runs the head of its queue (it must be startable) and reports it complete."""
    assert w.can_start(), f"{w.name} cannot start {units(sched, w)}"
    assert sched.collection is not None
    index = w.queue.pop(0)
    sched.mark_test_complete(w, index)
    return str(sched.collection[index])


def test_a_heavy_units_last_test_starts_without_waiting_for_the_queue_to_empty() -> None:
    workers = [Worker("gw0"), Worker("gw1"), Worker("gw2")]
    sched = scheduler(workers)
    stacks, compose, light = workers
    assert units(sched, stacks)[:2] == [STACKS, STACKS] and units(sched, stacks)[2:] == []
    # the compose test is one test: a short unit, the queue's last, is queued behind it, so it starts at once
    assert units(sched, compose) == [COMPOSE, "tests/unit/test_u3.py"] and compose.can_start()
    integration = "tests/integration/test_i.py"
    assert units(sched, light) == [integration, integration, "tests/unit/test_u1.py"]  # xdist's two units
    run(sched, stacks)  # the stacks' first test: the second is now the last, and gets company
    assert units(sched, stacks) == [STACKS, "tests/unit/test_u2.py"] and stacks.can_start()
    assert run(sched, compose) == COMPOSE + "::test_whole"


def test_every_test_runs_once_and_every_worker_is_shut_down() -> None:
    workers = [Worker("gw0"), Worker("gw1"), Worker("gw2")]
    sched = scheduler(workers)
    ran: list[str] = []
    while startable := [w for w in workers if w.can_start()]:
        ran.append(run(sched, startable[-1]))
    assert sorted(ran) == sorted(COLLECTION)
    assert all(w.shutting_down and not w.queue for w in workers)



def test_the_whole_stack_scenarios_are_two_units_and_every_listed_one_exists() -> None:
    assert unit_of("tests/e2e/test_kafka_cluster.py::test_x") == STACKS_B
    assert unit_of("tests/e2e/test_closed_loop.py::test_x") == STACKS
    assert unit_of(COMPOSE + "::test_x") == COMPOSE
    root = Path(__file__).resolve().parents[2]
    assert [m for m in sorted(STACKS_B_MODULES) if not (root / m).is_file()] == []


def test_the_long_integration_modules_go_first_in_their_order_and_each_exists() -> None:
    names = ["tests/unit/test_u.py::test_1", "tests/integration/test_short.py::test_1",
             *[f"{m}::test_1" for m in reversed(LONG_FIRST)], "tests/e2e/test_a.py::test_1"]
    ordered = [item.nodeid for item in order([SimpleNamespace(nodeid=n) for n in names])]  # type: ignore[misc]
    assert ordered == ["tests/e2e/test_a.py::test_1", *[f"{m}::test_1" for m in LONG_FIRST],
                       "tests/integration/test_short.py::test_1", "tests/unit/test_u.py::test_1"]
    root = Path(__file__).resolve().parents[2]
    assert [m for m in LONG_FIRST if not (root / m).is_file()] == []
