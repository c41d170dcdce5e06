"""Operator tooling: the ``rein`` command (``ops.cli``), its subcommands, and the demo.

``rein up/down/status/tail/replay/report`` and ``make demo`` live here; ``ops.local`` runs the
whole system as local processes without Docker. ops imports ``shared`` (and starts services as
processes); nothing in ``services`` or ``shared`` imports ops.
"""
