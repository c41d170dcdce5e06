"""Kafka, the only way services reach it: idempotent producer, manual-commit consumer, topic creation.

The thin adapter between services and kafka-python (STYLE 4): services hand in and get back
typed records (``shared.schemas``). What belongs here, by module: ``client`` (brokers, the
bounded connect, a constructor's cleanup, the result types every side shares), ``producer``, ``consumer`` (the group
member and the one-off readers) and ``admin`` (topics). Import from ``shared.bus``.
"""

from shared.bus.admin import admin_client, create_topics, ensure_topology, topic_configs
from shared.bus.client import BusUnavailable, DecodeHook, Delivered, Polled, RebalanceHook, new_client
from shared.bus.consumer import Consumer, read_at, read_topic
from shared.bus.producer import Producer

__all__ = [
    "BusUnavailable",
    "Consumer",
    "DecodeHook",
    "Delivered",
    "Polled",
    "Producer",
    "RebalanceHook",
    "admin_client",
    "create_topics",
    "ensure_topology",
    "new_client",
    "read_at",
    "read_topic",
    "topic_configs",
]
