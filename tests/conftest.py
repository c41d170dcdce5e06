"""Session fixtures: a real Kafka broker and a real Redis, started once per run, only when needed.

Service fixtures (session scope; the services are started by ``tests/support/infra.py`` through
``deploy/kafka.sh`` / ``deploy/redis.sh`` in a temp dir and stopped at the end of the run):

- ``kafka_bootstrap -> str``: ``"127.0.0.1:PORT"`` of a single-node KRaft broker
  (4 partitions by default, topic auto-creation off: create what you use).
- ``redis_url -> str``: ``"redis://127.0.0.1:PORT/0"``; the server has 64 logical DBs.
- ``kafka_admin -> KafkaAdminClient`` on that broker.
- ``topics -> shared.names.Topics``: the topics ``shared.topology`` declares (default names), created with 4 partitions.
  They are shared by the whole session; a test that reads what it wrote should use ``unique_topic``.

Per-test helpers (function scope):

- ``unique_topic(partitions=4, *, configs=None) -> str``: creates a fresh topic named after the test
  and waits until every partition has a leader.
- ``unique_group -> str``: a fresh consumer group id named after the test.
- ``redis_db_url -> str``: URL of a logical DB of its own (1..63, round robin), flushed first.
- ``redis_client -> redis.Redis`` on ``redis_db_url``; closed afterwards.

Whole local stacks (``ops.local.stack``) that fault no infrastructure run on the session's broker and Redis:
``stack_infra(name) -> SharedInfra`` (session scope, a factory) namespaces a stack's topics, consumer groups and
Redis keys; a stack that kills or restarts Kafka or Redis starts its own.

Hugging Face model fixtures (``smollm2_dir``, ``tiny_llama_dir``) live in ``tests/support/hf_model.py``.

The versions that ran are printed in the terminal summary.

Parallel runs (``make test``: pytest-xdist, ``tests/support/schedule.py`` says which worker runs what) share
one broker and one Redis (``tests/support/infra.py``); each worker takes its own block of ports and of
Redis DBs, and every topic and consumer group a test makes is its own. A run killed with SIGKILL leaves
nothing behind: ``tests/support/reaper.py`` watches it from outside.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import hypothesis
import pytest

from ops.local import warm
from tests.support.infra import KAFKA, NEEDS, REDIS, InfraError, RunInfra

if TYPE_CHECKING:
    import redis
    from kafka.admin import KafkaAdminClient

    from ops.local.stack import SharedInfra
    from shared.names import Topics

pytest_plugins = ["tests.support.hf_model"]  # smollm2_dir, tiny_llama_dir

# No per-example time limit: hypothesis' 200 ms deadline is a timing assertion, and on two shared
# cores it failed a correct property (test_offsets) under load. Every property keeps its examples.
hypothesis.settings.register_profile("rein", deadline=None, print_blob=True)
hypothesis.settings.load_profile("rein")

_INFRA = pytest.StashKey[RunInfra]()
_KEPT = pytest.StashKey[str]()
_REDIS_DBS = itertools.cycle(range(1, 64))
RUN_MARK = "PYTEST_REIN_RUN"
"""Set in the run's environment, so every process the run starts carries it (the reaper's key)."""
REAPER_DIR = "PYTEST_REIN_REAPER_DIR"
"""Where a test lists what the reaper must remove that does not inherit the environment (compose projects)."""


def _worker(config: pytest.Config) -> tuple[int, int] | None:
    """(index, count) of this pytest-xdist worker; None in the controller or a run without workers."""
    info = getattr(config, "workerinput", None)
    if info is None:
        return None
    return int(str(info["workerid"]).removeprefix("gw")), int(info["workercount"])


def _distributed(config: pytest.Config) -> bool:
    """This is the controller of a parallel run (its workers run the tests)."""
    return _worker(config) is None and getattr(config.option, "dist", "no") != "no"


TEST_KAFKA_JVM_OPTS = "-XX:TieredStopAtLevel=1"
"""Every broker a test starts (the session's, a stack's, a bench script's), and its storage format, compiles
with the JVM's quick compiler only: a test's broker lives a minute or two, about the time the optimising
compiler spends warming up, and took 40 % less CPU over a bench run this way (docs/development.md); a
storage format, 0.4-0.5 CPU-s instead of 0.7-1.0. Set ``KAFKA_JVM_OPTS`` to override."""


def pytest_configure(config: pytest.Config) -> None:
    global _REDIS_DBS
    os.environ.setdefault("KAFKA_JVM_OPTS", TEST_KAFKA_JVM_OPTS)
    os.environ.setdefault(warm.ENV_FLAG, "1")  # services forked from a warm server (ops/local/warm.py)
    worker = _worker(config)
    if worker is not None:  # one broker and Redis for the run; ports and Redis DBs of its own
        from ops.local import ports

        index, count = worker
        ports.use_block(index, count)
        os.environ["REIN_PORT_BLOCK"] = f"{index}/{count}"  # for the deploy scripts this worker runs
        _REDIS_DBS = itertools.cycle(range(1 + index, 64, count))
        config.stash[_INFRA] = RunInfra(Path(config.workerinput["rein_infra_root"]), shared=True)  # type: ignore[attr-defined]
        return
    _start_reaper()
    if _distributed(config):
        config.option.loadscopereorder = False  # tests/support/schedule.py orders the units itself
        config.stash[_INFRA] = RunInfra(Path(tempfile.mkdtemp(prefix="rein-infra-")))  # the workers' shared root
    else:
        config.stash[_INFRA] = RunInfra()
    # Backstop for a run killed with SIGTERM (e.g. a CI timeout): stop our services, then die as asked.
    if threading.current_thread() is threading.main_thread():
        previous = signal.getsignal(signal.SIGTERM)

        def on_sigterm(signum: int, frame: FrameType | None) -> None:
            infra = _stop_services(config)
            if infra.root is not None:
                capman = config.pluginmanager.getplugin("capturemanager")
                with capman.global_and_fixture_disabled() if capman else contextlib.nullcontext():
                    print(f"\nrein infra: SIGTERM, services stopped; data and logs in {infra.root}", file=sys.stderr)
            if callable(previous):
                previous(signum, frame)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

        signal.signal(signal.SIGTERM, on_sigterm)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: `pytest -p no:xdist` runs without it
def pytest_configure_node(node: Any) -> None:
    """pytest-xdist, in the controller: each worker is told the root its services are shared under."""
    node.workerinput["rein_infra_root"] = str(node.config.stash[_INFRA].workdir())


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from tests.support.schedule import ModulesHeavyFirst

    return ModulesHeavyFirst(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The order a parallel run hands out its units in (tests/support/schedule.py); a serial run keeps it too."""
    from tests.support.schedule import order

    items[:] = order(items)


def _start_reaper() -> None:
    """Start tests/support/reaper.py watching this process, then join the run's cgroup and mark the environment
    (every process this run starts stays in the one and inherits the other)."""
    from tests.support.reaper import join_cgroup

    mark, directory = uuid.uuid4().hex, tempfile.mkdtemp(prefix="rein-reaper-")
    env = {k: v for k, v in os.environ.items() if k not in (RUN_MARK, REAPER_DIR)}
    devnull = [(os.POSIX_SPAWN_OPEN, fd, os.devnull, os.O_RDWR, 0) for fd in (0, 1, 2)]
    script = str(Path(__file__).resolve().parent / "support" / "reaper.py")
    # posix_spawn in a new session, before joining the cgroup: nothing to wait for here (it outlives this
    # process by design), and neither a signal to this run's process group nor its cgroup reaches it
    os.posix_spawn(sys.executable, [sys.executable, script, str(os.getpid()), mark, directory],
                   env, file_actions=devnull, setsid=True)
    join_cgroup(mark)
    os.environ[RUN_MARK] = mark
    os.environ[REAPER_DIR] = directory


def _stop_services(config: pytest.Config) -> RunInfra:
    """Stop the run's services (in a parallel run's controller: those its workers started); the RunInfra that did."""
    infra = config.stash[_INFRA]
    if _distributed(config):
        infra = RunInfra.adopt(infra.workdir())
        config.stash[_INFRA] = infra
    infra.stop_all()
    return infra


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start, concurrently and in the background, the services the selected tests need."""
    if session.config.option.collectonly:
        return
    needed = {svc for item in session.items for name, svc in NEEDS.items() if name in getattr(item, "fixturenames", ())}
    session.config.stash[_INFRA].prestart(needed)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    if _worker(config) is not None:
        config.stash[_INFRA].stop_all()  # lets its starts finish: the controller stops the services
        return
    config.stash[_KEPT] = _stop_services(config).cleanup(keep=exitstatus != 0)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    infra = config.stash[_INFRA]
    lines = infra.summary()
    if not lines:
        return
    terminalreporter.section("rein infra: services that ran")
    for line in lines:
        terminalreporter.write_line(line)
    kept = config.stash.get(_KEPT, "")
    if kept:
        terminalreporter.write_line(kept)


def _require(request: pytest.FixtureRequest, name: str) -> str:
    try:
        return request.config.stash[_INFRA].require(name).address
    except InfraError as exc:
        message = str(exc)
    pytest.fail(message, pytrace=False)


@pytest.fixture(scope="session")
def kafka_bootstrap(request: pytest.FixtureRequest) -> str:
    """``127.0.0.1:PORT`` of the session's real Kafka broker."""
    return _require(request, KAFKA)


@pytest.fixture(scope="session")
def redis_url(request: pytest.FixtureRequest) -> str:
    """``redis://127.0.0.1:PORT/0`` of the session's real Redis."""
    return _require(request, REDIS)


@pytest.fixture(scope="session")
def stack_infra(kafka_bootstrap: str, redis_url: str) -> Callable[[str], SharedInfra]:
    """Factory: ``stack_infra(name)`` is the session's Kafka and Redis for one local stack, everything it names
    under a namespace of its own (``s.<name>.<hex>``), so that stacks and tests running beside it stay apart."""
    from ops.local.stack import SharedInfra

    def make(name: str) -> SharedInfra:
        return SharedInfra(kafka_bootstrap, redis_url, namespace=f"s.{name}.{uuid.uuid4().hex[:8]}")

    return make


@pytest.fixture(scope="session")
def kafka_admin(kafka_bootstrap: str) -> Iterator[KafkaAdminClient]:
    from kafka.admin import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap, client_id="rein-tests-admin")
    try:
        yield admin
    finally:
        admin.close()


def _create_topics(admin: KafkaAdminClient, partitions: dict[str, int], configs: dict[str, dict[str, str]]) -> None:
    from shared.bus import create_topics

    create_topics(admin, partitions, configs)


@pytest.fixture(scope="session")
def topics(kafka_admin: KafkaAdminClient) -> Topics:
    """The topics ``shared.topology`` declares and specifies, under their default names (shared by the session)."""
    from shared.names import Topics
    from shared.topology import topic_specs

    names = Topics()
    specs = topic_specs(names)
    _create_topics(kafka_admin, {n: s.partitions for n, s in specs.items()}, {n: s.configs for n, s in specs.items()})
    return names


def _slug(request: pytest.FixtureRequest) -> str:
    return re.sub(r"[^a-zA-Z0-9._-]+", "-", request.node.name).strip("-")[:120]


@pytest.fixture
def unique_topic(request: pytest.FixtureRequest, kafka_admin: KafkaAdminClient) -> Callable[..., str]:
    """Factory: ``unique_topic(partitions=4, *, configs=None)`` creates a fresh topic, returns its name."""

    def make(partitions: int = 4, *, configs: dict[str, str] | None = None) -> str:
        name = f"t.{_slug(request)}.{uuid.uuid4().hex[:8]}"
        _create_topics(kafka_admin, {name: partitions}, {name: configs or {}})
        return name

    return make


@pytest.fixture
def unique_group(request: pytest.FixtureRequest) -> str:
    """A consumer group id no other test uses."""
    return f"g.{_slug(request)}.{uuid.uuid4().hex[:8]}"


@pytest.fixture
def redis_db_url(redis_url: str) -> str:
    """URL of a logical DB (1..63, round robin) flushed for this test; DB 0 is left to the caller."""
    import redis

    db = next(_REDIS_DBS)
    url = f"{redis_url.rsplit('/', 1)[0]}/{db}"
    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()
    return url


@pytest.fixture
def redis_client(redis_db_url: str) -> Iterator[redis.Redis]:
    """A ``redis.Redis`` on this test's own flushed logical DB."""
    import redis

    client = redis.Redis.from_url(redis_db_url)
    try:
        yield client
    finally:
        client.close()
