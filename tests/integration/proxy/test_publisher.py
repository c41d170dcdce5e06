"""The proxy's publisher against a real broker: submission order, the in-flight bound, the gauges.

The producer's linger holds every batch for a second, so an ack cannot come sooner: a submit
that returns while an earlier record's ack is still pending did not wait for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry

from services.proxy.metrics import ProxyMetrics
from services.proxy.publisher import Publisher
from shared.codec import encode
from shared.schemas import Chunk
from shared.settings import KafkaSettings
from tests.support.proxy import read_records

pytestmark = [pytest.mark.integration]

BOUND = 1024


def _chunk(seq: int, tokens: int) -> Chunk:
    return Chunk(session_id="s", group_id="g", seq=seq, segment_index=0, chunk_index=seq,
                 output_ids=list(range(tokens)), logprobs=[-0.5] * tokens, finish_reason="length")


def test_submits_keep_order_wait_for_room_and_a_record_over_the_bound_goes_alone(
    kafka_bootstrap: str, unique_topic: Callable[..., str]
) -> None:
    topic = unique_topic()
    big, a, b = _chunk(0, 400), _chunk(1, 60), _chunk(2, 60)
    assert len(encode(big)) > BOUND and BOUND / 2 < len(encode(a)) == len(encode(b)) < BOUND

    async def body() -> None:
        metrics = ProxyMetrics(CollectorRegistry())
        publisher = Publisher(KafkaSettings(bootstrap_servers=kafka_bootstrap, linger_ms=1000), BOUND, metrics)
        try:
            ack_big = await publisher.submit(topic, big)  # nothing in flight: it goes, alone, at once
            assert not ack_big.done()
            assert (publisher.inflight_records, publisher.inflight_bytes) == (1, len(encode(big)))
            assert metrics.registry.get_sample_value("rein_proxy_publish_inflight_bytes") == len(encode(big))
            ack_a = await publisher.submit(topic, a)  # waited for room: the big record is answered
            assert ack_big.done() and not ack_a.done()
            ack_b = await publisher.submit(topic, b)  # a and b together pass the bound
            assert ack_a.done() and not ack_b.done()
            await ack_b
            assert (publisher.inflight_records, publisher.inflight_bytes) == (0, 0)
            assert metrics.registry.get_sample_value("rein_proxy_chunks_published_total") == 3
            assert metrics.registry.get_sample_value("rein_proxy_publish_inflight_bytes") == 0
        finally:
            await publisher.close()

    asyncio.run(asyncio.wait_for(body(), 60))  # a submit that never gets room fails instead of hanging
    records = read_records(kafka_bootstrap, topic, 3)
    assert [r.seq for r in records if isinstance(r, Chunk)] == [0, 1, 2]  # one key, one partition, in order
