"""Ports for local services come from below the ephemeral range, so outgoing connections cannot take them."""

from __future__ import annotations

import random
import socket
import subprocess
from pathlib import Path

import pytest

from ops.local.ports import DEFAULT_EPHEMERAL_RANGE, LOWEST_PORT, ephemeral_range, free_ports
from ops.local.stack import _port_allocator

REPO_ROOT = Path(__file__).resolve().parents[3]


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    low, _ = ephemeral_range()
    ports = free_ports(8)
    assert len(set(ports)) == 8
    for port in ports:
        assert LOWEST_PORT <= port < low
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_someone_listens_on_is_never_chosen() -> None:
    seeded = random.Random(7)
    first = free_ports(1, rng=random.Random(7))[0]
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", first))
        listener.listen()
        again = free_ports(1, rng=seeded)[0]  # the same random sequence starts at the taken port
    assert again != first


def test_a_crowded_range_falls_back_to_the_kernel_choice() -> None:
    low, high = ephemeral_range()
    ports = free_ports(3, ephemeral=(LOWEST_PORT + 10, 60999))
    assert len(set(ports)) == 3
    assert all(low <= port <= high for port in ports)  # the kernel's choice comes from the ephemeral range


def test_an_unreadable_range_file_gives_the_linux_default(tmp_path: Path) -> None:
    assert ephemeral_range(tmp_path / "missing") == DEFAULT_EPHEMERAL_RANGE
    garbled = tmp_path / "range"
    garbled.write_text("not numbers")
    assert ephemeral_range(garbled) == DEFAULT_EPHEMERAL_RANGE
    garbled.write_text("20000\t40000\n")
    assert ephemeral_range(garbled) == (20000, 40000)


def test_zero_ports_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        free_ports(0)


def test_the_deploy_scripts_can_run_it_without_the_virtualenv() -> None:
    out = subprocess.run(
        ["python3", str(REPO_ROOT / "ops" / "local" / "ports.py"), "2"],
        capture_output=True, text=True, check=True, timeout=30,
    )
    low, _ = ephemeral_range()
    ports = [int(p) for p in out.stdout.split()]
    assert len(set(ports)) == 2
    assert all(LOWEST_PORT <= port < low for port in ports)


def test_a_stack_never_hands_out_one_port_twice() -> None:
    """Each free choice releases its port, so two choices can return one port: the stack's allocator skips it."""
    choices = iter([20001, 20002, 20001, 20002, 20003])
    port = _port_allocator(0, lambda: next(choices))
    assert [port(), port(), port()] == [20001, 20002, 20003]
    fixed = _port_allocator(30000)
    assert [fixed(), fixed()] == [30000, 30001]
