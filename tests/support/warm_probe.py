"""A stand-in service for the warm server's tests: prints what a ``python -m`` process sees, then exits as asked.

``PROBE_EXIT``: the exit code, or ``wait`` to sleep until a signal ends it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path


def main() -> None:
    seen = {
        "name": __name__, "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "env": dict(os.environ),
        "sid": os.getsid(0), "pgid": os.getpgid(0), "comm": Path("/proc/self/comm").read_text().strip(),
        "stdin": sys.stdin.read(),
    }
    print(json.dumps(seen), flush=True)
    exit_as = os.environ.get("PROBE_EXIT", "0")
    if exit_as == "wait":
        signal.pause()
    sys.exit(int(exit_as))


if __name__ == "__main__":
    main()
