"""Free TCP ports on 127.0.0.1, chosen below the kernel's ephemeral range.

Binding port 0 returns a port from the ephemeral range, the range the kernel also hands to
every outgoing connection. Between choosing such a port and the service binding it, or while a
killed service is down before it restarts on the same port, a client connection (a Kafka or
Redis client, say) can take it, and the service dies with EADDRINUSE. Ports below that range
are never given out implicitly, so only another listener can take them.

Standard library only: ``deploy/kafka.sh`` and ``deploy/redis.sh`` run it as a script
(``python3 ops/local/ports.py N`` prints N ports) before any virtualenv exists.
"""

from __future__ import annotations

import random
import socket
import sys
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL_RANGE = (32768, 60999)  # Linux's default
LOWEST_PORT = 10000
"""Chosen ports start here: below it lie many well-known and registered services."""
MIN_CHOICE = 1000
"""Below this many candidates the range is too crowded; fall back to the kernel's choice."""
ATTEMPTS = 500


def ephemeral_range(path: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's ephemeral port range, or Linux's default where it cannot be read."""
    try:
        low, high = (int(part) for part in path.read_text().split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL_RANGE
    return low, high


def _bound(port: int) -> socket.socket | None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        sock.close()
        return None
    return sock


def free_ports(count: int, *, rng: random.Random | None = None, ephemeral: tuple[int, int] | None = None) -> list[int]:
    """``count`` distinct ports that were free a moment ago (all held until all are chosen)."""
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    rng = rng or random.Random()
    low, _ = ephemeral or ephemeral_range()
    held: list[socket.socket] = []
    try:
        if low - LOWEST_PORT >= MIN_CHOICE:
            for _ in range(ATTEMPTS):
                if len(held) == count:
                    break
                sock = _bound(rng.randrange(LOWEST_PORT, low))  # a port held already fails to bind
                if sock is not None:
                    held.append(sock)
        while len(held) < count:  # crowded or unusual range: the kernel's own choice
            sock = _bound(0)
            if sock is None:
                raise OSError("no free TCP port on 127.0.0.1")
            held.append(sock)
        return [s.getsockname()[1] for s in held]
    finally:
        for sock in held:
            sock.close()


def free_port() -> int:
    """One port that was free a moment ago."""
    return free_ports(1)[0]


if __name__ == "__main__":
    print(" ".join(str(p) for p in free_ports(int(sys.argv[1]) if len(sys.argv) > 1 else 1)))
