"""What the services share, and nothing else.

Pure rules (``staleness``, ``versions``, ``offsets``, ``window_view``), the record schemas
(``schemas``, ``names``), the transports (``bus`` for Kafka; ``state`` and ``window_layout``
for Redis; ``topology`` for the topics), the runtime every service uses (``settings``,
``log``, ``metrics``, ``status_server``, ``http_server``, ``lender``, ``outage``, ``errors``), and the
model layer (policy, tokenizer, checkpoints). shared/ imports neither ``services`` nor
``ops``; operator tooling lives in ``ops``.
"""
