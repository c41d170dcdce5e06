"""The run's CPU by kind of process (tests/support/cpu_by_process.py): naming a process from its command line,
and the totals, without the CPU a process had before the sampling began."""

from __future__ import annotations

import pytest

from tests.support.cpu_by_process import Seen, kind_of, summary


@pytest.mark.parametrize(
    ("cmdline", "kind"),
    [
        ("java -Xmx512m -cp /opt/kafka/libs/* kafka.Kafka /tmp/pytest-of-root/k/server.properties", "kafka broker"),
        ("java -Xmx256m -cp /c/libs/* kafka.tools.StorageTool format -t x", "kafka storage format"),
        ("/venv/bin/python -m services.engine", "services.engine"),
        ("/venv/bin/python /repo/bench/pipeline.py --steps 3", "bench/pipeline.py"),
        ("/venv/bin/python -u -c import sys;exec(eval(sys.stdin.readline()))", "pytest worker"),
        ("/usr/bin/redis-server 127.0.0.1:6379", "redis"),
        ("/usr/bin/containerd-shim-runc-v2 -namespace moby", "containerd-shim"),
        ("docker compose -p rein-test ps", "docker cli"),
        ("/usr/sbin/haproxy -f /etc/haproxy.cfg", "other: haproxy"),
        ("", "?"),
    ],
)
def test_a_process_is_named_by_its_command_line(cmdline: str, kind: str) -> None:
    assert kind_of(cmdline) == kind


@pytest.mark.parametrize(
    ("comm", "kind"),
    [("python", "warm server"), ("engine", "services.engine"), ("weight_broadcas", "services.weight_broadcaster"),
     ("warm_probe", "warm child: warm_probe")],
)
def test_a_warm_child_is_named_by_its_process_name(comm: str, kind: str) -> None:
    assert kind_of("/venv/bin/python -m ops.local.warm", comm) == kind


def test_the_totals_leave_out_what_a_process_had_used_before_the_sampling() -> None:
    seen = {
        ("10", "1"): Seen("kafka broker", "tests/e2e/test_a.py", 12.0, base_s=10.0),  # running before: 2 s count
        ("11", "5"): Seen("kafka broker", "tests/e2e/test_b.py", 3.0),
        ("12", "6"): Seen("services.engine", "", 4.0),
    }
    assert summary(seen) == {
        "kinds": {"kafka broker": [5.0, 2], "services.engine": [4.0, 1]},
        "modules": {"(none)": [4.0, 1], "tests/e2e/test_b.py": [3.0, 1], "tests/e2e/test_a.py": [2.0, 1]},
    }
