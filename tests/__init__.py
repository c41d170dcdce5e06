"""rein's tests, laid out like the code they test.

- ``unit/<package>/test_<module>.py``: pure and in-process tests, no broker, no Redis
  (packages: ``shared``, ``collector``, ``trainer``, ``rollout``, ``engine``, ``proxy``,
  ``broadcaster`` for ``services/weight_broadcaster``, ``ops`` for operator tooling and deploy files).
- ``integration/<package>/test_<module>.py``: the same packages against the real Kafka and Redis
  the session fixtures start; the top level of ``integration/`` holds the suites that span
  packages (``test_fault_bad_input.py``, ``test_infra_smoke.py``).
- ``e2e/``: whole-loop scenarios (marked ``slow``).
- ``bench/``: every ``bench/*.py`` script run once with tiny settings (exits 0, writes its JSON),
  so none rots; a script without a smoke entry fails the suite.
- ``support/``: helpers the tests import (no tests): the infra behind the fixtures, process
  starters (one for engine and proxy: ``support/stack.py``), per-service harnesses, bounded waits.
- ``conftest.py``: the fixtures, the one entry point.
"""
