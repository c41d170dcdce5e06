"""Where a test run's time goes: the slowest tests and each directory's share, from pytest's JUnit XML.

``python -m tests.support.durations junit.xml [--top 25]``. A test's time is its setup, call and
teardown together, as pytest-xdist reports it per test; a module fixture's setup (a whole stack)
counts in the first test that uses it. With parallel workers the shares are of the summed test
time, not of the wall time.
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from pathlib import Path

GROUPS = ("tests.unit", "tests.integration", "tests.bench", "tests.e2e.test_compose", "tests.e2e")
"""Directories (and the compose test, which is an e2e module of its own kind), the first match wins."""


def read(path: Path) -> list[tuple[str, float]]:
    """``(dotted module[.class]::test, seconds)`` of every test case in the report."""
    return [(f"{case.get('classname', '')}::{case.get('name', '')}", float(case.get("time", "0")))
            for case in ET.parse(path).getroot().iter("testcase")]


def group_of(test_id: str) -> str:
    return next((g for g in GROUPS if test_id.startswith(g)), "other")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit", type=Path)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    cases = read(args.junit)
    total = sum(s for _, s in cases)
    print(f"{len(cases)} tests, {total:.0f} s of test time\n\nslowest {args.top}:")
    for test_id, seconds in sorted(cases, key=lambda c: -c[1])[: args.top]:
        print(f"{seconds:8.1f} s  {test_id}")
    shares: dict[str, float] = {}
    for test_id, seconds in cases:
        shares[group_of(test_id)] = shares.get(group_of(test_id), 0.0) + seconds
    print("\nby directory:")
    for group, seconds in sorted(shares.items(), key=lambda kv: -kv[1]):
        print(f"{seconds:8.1f} s  {seconds / total:6.1%}  {group}")


if __name__ == "__main__":
    main()
