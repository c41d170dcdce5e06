"""Collector: Kafka chunks/events -> GRPO groups -> one shared version window in Redis -> batch manifests.

Modules: ``assembly`` (pure record folding and commit offsets), ``window_store`` (the
atomic Redis step and the outbox), ``service`` (the loop and ``/metrics``),
``settings``, ``__main__`` (entry point).
"""
