"""What a killed test run leaves behind, stopped: ``python tests/support/reaper.py PID MARK DIR``.

A test run starts Kafka, Redis, rein services, HAProxy, dockerd, agent commands and compose projects,
each in a process group of its own or daemonized, so none dies with the run. The run stops them itself
at its end and on SIGTERM, but a SIGKILL (CI's time limit past its grace, a second Ctrl-C) gives it no
chance. So every run starts this watcher first, in a session of its own, and then joins a cgroup of its
own (:func:`join_cgroup`; every process it starts stays in it, daemonized or not). Once process ``PID``
(the run) is gone, however it ended, the watcher removes the compose projects listed in
``DIR/compose-projects`` (containers live in dockerd's cgroups), then stops every process left in the
run's cgroup or carrying ``MARK`` in its environment (``PYTEST_REIN_RUN=<id>``, inherited by every
child; the fallback where no cgroup hierarchy is writable, blind to Redis, which overwrites its
environment for its process title): SIGTERM, and SIGKILL for what is left after :data:`GRACE_S`.
After a clean end there is nothing left to stop. Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

CGROUPS = Path("/sys/fs/cgroup/pids")
"""The cgroup v1 hierarchy a run joins (every process belongs to one, and no controller limit is set)."""
GRACE_S = 5.0
GIVE_UP_S = 60.0
POLL_S = 0.2


def cgroup_of(mark: str) -> Path:
    return CGROUPS / f"rein-test-{mark}"


def join_cgroup(mark: str) -> Path | None:
    """Move this process into a new cgroup for the run ``mark`` (its children follow); None where none can be
    made (no such hierarchy, not root)."""
    group = cgroup_of(mark)
    try:
        group.mkdir()
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError:
        with contextlib.suppress(OSError):
            group.rmdir()
        return None
    return group


def members(mark: str) -> list[int]:
    """Pids in the run's cgroup, and pids (not this one) whose initial environment holds its mark."""
    found: set[int] = set()
    with contextlib.suppress(OSError):
        found.update(int(p) for p in (cgroup_of(mark) / "cgroup.procs").read_text().split())
    entry = f"PYTEST_REIN_RUN={mark}".encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if entry in (proc / "environ").read_bytes().split(b"\0"):
                found.add(int(proc.name))
        except OSError:  # gone, or not ours
            continue
    found.discard(os.getpid())
    return sorted(p for p in found if not _zombie(p))


def _zombie(pid: int) -> bool:
    """Exited already (its parent has yet to reap it), or gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] == "Z"
    except OSError:
        return True


def wait_for_exit(pid: int) -> None:
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        select.select([fd], [], [])
    finally:
        os.close(fd)


def remove_compose_projects(directory: Path) -> None:
    listing = directory / "compose-projects"
    if not listing.exists():
        return
    for project in filter(None, listing.read_text().split()):
        label = f"label=com.docker.compose.project={project}"
        for kind, ls in (("container", ["ps", "-aq"]), ("network", ["network", "ls", "-q"]),
                         ("volume", ["volume", "ls", "-q"])):
            ids = subprocess.run(["docker", *ls, "--filter", label], capture_output=True, text=True,
                                 timeout=60, check=False).stdout.split()
            if ids:
                remove = ["rm", "-f"] if kind == "container" else [kind, "rm", "-f"]
                subprocess.run(["docker", *remove, *ids], capture_output=True, timeout=120, check=False)


def stop(mark: str) -> None:
    """SIGTERM what the run left, SIGKILL what is still there after :data:`GRACE_S`, until nothing is left."""
    started = time.monotonic()
    deadline, sent = started + GRACE_S, set()
    while (victims := members(mark)) and time.monotonic() < started + GIVE_UP_S:
        late = time.monotonic() > deadline
        for victim in victims:
            if late or victim not in sent:
                with contextlib.suppress(ProcessLookupError):  # exited meanwhile
                    os.kill(victim, signal.SIGKILL if late else signal.SIGTERM)
                sent.add(victim)
        time.sleep(POLL_S)


def remove_cgroup(mark: str) -> None:
    """Remove the run's cgroup once it is empty: a killed process stays listed until its parent (init, for
    an orphan) has reaped it, which can take a moment."""
    group, deadline = cgroup_of(mark), time.monotonic() + GIVE_UP_S
    while group.exists() and time.monotonic() < deadline:
        try:
            group.rmdir()
        except OSError:  # EBUSY: not empty yet
            time.sleep(POLL_S)


def main(argv: list[str]) -> int:
    pid, mark, directory = int(argv[0]), argv[1], Path(argv[2])
    wait_for_exit(pid)
    with contextlib.suppress(OSError, subprocess.SubprocessError):  # no docker here: no project was started
        remove_compose_projects(directory)
    stop(mark)
    remove_cgroup(mark)
    shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
