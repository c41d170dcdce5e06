"""Helpers the tests import (nothing here is collected as a test).

- ``infra``: the session's real Kafka and Redis, behind ``tests/conftest.py``'s fixtures.
- ``procs``: any service as a subprocess, healthy before it is returned, stopped by PID.
- ``stack``: the one starter of real engine and proxy processes.
- ``proxy``: the proxy suites' in-thread proxy factory and Kafka readers.
- ``collector``: collector settings, record sources and topic tails, a replica in a thread.
- ``rebalance``: a foreign consumer-group member that forces rebalances.
- ``wait``: ``wait_until``, a bounded wait on a condition.
- ``gradients``: the gradient a trainer's optimizer stepped with (the step frees it afterwards).
"""
