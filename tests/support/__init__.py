"""Helpers the tests import (nothing here is collected as a test); each module's docstring says more.

Infrastructure and processes: ``infra`` (the session's real Kafka and Redis), ``procs`` (a service as a
subprocess, healthy before it is returned), ``stack`` (the one starter of engine and proxy processes),
``reaper`` and ``killed_run_probe`` (a killed run leaves nothing behind), ``wait`` (``wait_until``, the
tests' bounded replacement for sleeps).

Per service: ``proxy``, ``engine_fronts``, ``generation_engine`` (the proxy); ``collector``,
``rollout_records`` (the collector); ``rollout_runner`` (the runner); ``trainer_kafka``, ``gradients``,
``warm_policy`` (the trainer); ``broadcaster_fakes`` (the broadcaster); ``chat_turns``, ``templates``,
``hf_model`` (chat templates and models); ``scripted_agent``, ``sglang_engine`` (agents and SGLang's API).

Records and read-back: ``kafka_io``, ``readback``, ``fault_runs`` (what the e2e runs that break the stack
share besides read-back), ``rebalance``, ``poison``, ``proxy_fuzz``, ``demo_runs``; checks shared by registries
(``registry``) and by the compose file (``compose_file``).

The run itself: ``schedule`` (which xdist worker runs what), ``timeline`` and ``durations`` (where a run's
time goes).
"""
