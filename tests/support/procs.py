"""Start a rein service as a real subprocess and wait until it is healthy (integration tests).

The launcher is the one in :mod:`ops.local.launcher`; these names keep the tests' imports.
"""

from __future__ import annotations

from ops.local.launcher import REPO as REPO_ROOT
from ops.local.launcher import LaunchError as ServiceStartError
from ops.local.launcher import Service as Proc
from ops.local.launcher import start_service

__all__ = ["REPO_ROOT", "Proc", "ServiceStartError", "start_service"]
