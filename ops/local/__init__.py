"""The system as local processes without Docker: Kafka, Redis and every service as children.

``launcher`` starts and stops processes (infrastructure through ``deploy/*.sh``, services as
``python -m``), ``stack`` is the one description of the local topology (which services, in
what order, with what settings) used by ``rein up``, the demo, the end-to-end tests and
``bench``, and ``ports`` picks free ports. ``docker-compose.yml`` is the container twin of
``stack`` and stays separate.
"""
