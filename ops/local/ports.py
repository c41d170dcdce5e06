"""Free TCP ports on 127.0.0.1, chosen below the kernel's ephemeral range.

Binding port 0 returns a port from the ephemeral range, the range the kernel also hands to
every outgoing connection. Between choosing such a port and the service binding it, or while a
killed service is down before it restarts on the same port, a client connection (a Kafka or
Redis client, say) can take it, and the service dies with EADDRINUSE. Ports below that range
are never given out implicitly, so only another listener can take them.

Processes that choose ports side by side (parallel test workers) each take their own block of that
range, so two of them never hand out the same port in the moment between choosing it and binding it:
``REIN_PORT_BLOCK=I/N`` in the environment (inherited by every process a worker starts: bench scripts,
the deploy scripts), :func:`use_block`, or ``--block I/N`` on the command line. This module reads the
environment itself (an exception to rein's rule that only ``shared.settings`` does): it must run with the
standard library alone.

Standard library only: ``deploy/kafka.sh`` and ``deploy/redis.sh`` run it as a script
(``python3 ops/local/ports.py N [--block I/N]`` prints N ports) before any virtualenv exists.
"""

from __future__ import annotations

import os
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


def _parse_block(text: str) -> tuple[int, int]:
    index, _, count = text.partition("/")
    return int(index), int(count)


_block: tuple[int, int] | None = _parse_block(os.environ["REIN_PORT_BLOCK"]) if os.environ.get("REIN_PORT_BLOCK") \
    else None


def use_block(index: int, count: int) -> None:
    """Choose ports from block ``index`` of ``count`` equal blocks of the range from now on (this process)."""
    global _block
    if not 0 <= index < count:
        raise ValueError(f"block {index} of {count}")
    _block = (index, count)


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
    start, stop = LOWEST_PORT, low
    if _block is not None:
        size = (low - LOWEST_PORT) // _block[1]
        start, stop = LOWEST_PORT + _block[0] * size, LOWEST_PORT + (_block[0] + 1) * size
    held: list[socket.socket] = []
    try:
        if stop - start >= MIN_CHOICE:
            for _ in range(ATTEMPTS):
                if len(held) == count:
                    break
                sock = _bound(rng.randrange(start, stop))  # a port held already fails to bind
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


def _main(argv: list[str]) -> str:
    args = list(argv)
    if "--block" in args:
        at = args.index("--block")
        use_block(*_parse_block(args[at + 1]))
        del args[at : at + 2]
    return " ".join(str(p) for p in free_ports(int(args[0]) if args else 1))


if __name__ == "__main__":
    print(_main(sys.argv[1:]))
