"""Weight broadcaster: consumes ``WeightPublished`` on ``weights``, owns the version registry's
order in Redis, pauses every proxy, updates every engine, resumes, and publishes ``WeightApplied``.
Entry point: ``python -m services.weight_broadcaster``; the wiring is in :mod:`services.weight_broadcaster.loop`.
"""
