"""Which worker of a parallel run (``make test``, pytest-xdist) runs what, and in what order.

A unit of work is a test module: one worker runs it whole, so its module fixtures (a proxy and an
engine, a scenario run) start once. The end-to-end scenarios that start a whole stack are two units
(:data:`STACKS` and :data:`STACKS_B`, about 300 s of a run each): within one, they run one at a time.
The heavy units (those stacks, the compose test, the bench smoke runs) are handed out first, each to a
worker of its own that takes nothing else until it is down to its last test; the integration modules
(the longest first) and then the unit modules fill the other workers and, once a heavy unit ends, its worker.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from xdist.scheduler import LoadScopeScheduling

STACKS = "tests/e2e (whole stacks, one at a time)"
STACKS_B = "tests/e2e (whole stacks, second group)"
STACKS_B_MODULES = frozenset(f"tests/e2e/test_{name}.py" for name in
                             ("engine_replicas", "kafka_cluster", "redis_failover", "smollm2", "stop_bounded"))
"""The whole-stack scenarios of :data:`STACKS_B`; every other one is in :data:`STACKS`. One unit of them all was
the run's longest (596 s of a 596 s run, the last 75 s with one core idle); split, each group is about 300 s."""
COMPOSE = "tests/e2e/test_compose.py"
BENCH = "tests/bench/test_smoke.py"
HEAVY = (STACKS, STACKS_B, COMPOSE, BENCH)
"""Units in the order they are handed out, before every other."""
LONG_FIRST = tuple(f"tests/integration/{name}.py" for name in (
    "trainer/test_loop", "broadcaster/test_control_plane", "rollout/test_runner", "proxy/test_publish",
    "agents/test_wires", "agents/test_smollm2_agents", "proxy/test_partial_rollout"))
"""The integration modules that took 30 s or more of a run (``python -m tests.support.timeline``, docs/development.md),
longest first, handed out before the other integration modules: taken in collection order, ``trainer/test_loop``
(61 s) came last and ran alone at the end of a run while the other workers were done."""


def unit_of(nodeid: str) -> str:
    """The unit a test belongs to: its module, or a stacks group for a whole-stack scenario."""
    module = nodeid.split("::", 1)[0]
    if module.startswith("tests/e2e/") and module != COMPOSE:
        return STACKS_B if module in STACKS_B_MODULES else STACKS
    return module


def rank(nodeid: str) -> int:
    """0.. for the heavy units in :data:`HEAVY` order, then the long integration modules in :data:`LONG_FIRST`
    order, then the other integration modules, then the rest."""
    unit = unit_of(nodeid)
    if unit in HEAVY:
        return HEAVY.index(unit)
    if unit in LONG_FIRST:
        return len(HEAVY) + LONG_FIRST.index(unit)
    return len(HEAVY) + len(LONG_FIRST) + (0 if unit.startswith("tests/integration/") else 1)


def order(items: Sequence[pytest.Item]) -> list[pytest.Item]:
    """``items`` by :func:`rank`, collection order kept within a rank."""
    return sorted(items, key=lambda item: rank(item.nodeid))


class ModulesHeavyFirst(LoadScopeScheduling):  # type: ignore[misc]
    """xdist's scheduling by scope, with :func:`unit_of` as the scope and no second unit queued on a worker
    still busy with a heavy one (it would wait there while other workers run dry). The queue follows the
    collection order, which :func:`order` set.

    One exception: an xdist worker starts a test only once it knows the next one (or that there is none),
    so the last test queued on a worker waits until the scheduler sends more or shuts the worker down. A
    heavy unit down to its last test (the compose test is one test) therefore gets one more unit behind it,
    the last in the queue (a short unit-test module), or, with the queue empty, the shutdown. Without it
    the compose test sat on its worker unstarted until the whole queue was handed out and then ran alone
    at the end (146 of a 720 s run)."""

    def _split_scope(self, nodeid: str) -> str:
        return unit_of(nodeid)

    def _reschedule(self, node: Any) -> None:
        assigned = self.assigned_work.get(node, {})
        busy = any(scope in HEAVY and not all(done.values()) for scope, done in assigned.items())
        if not busy or not self.workqueue:
            super()._reschedule(node)
        elif not node.shutting_down and self._pending_of(assigned) == 1:
            self._assign_last_unit(node)

    def _assign_last_unit(self, node: Any) -> None:
        scope, work_unit = self.workqueue.popitem(last=True)
        self.assigned_work.setdefault(node, {})[scope] = work_unit
        collection = self.registered_collections[node]
        node.send_runtest_some([collection.index(nodeid) for nodeid, done in work_unit.items() if not done])
