"""A Kafka client whose constructor failed after connecting leaves no connection open.

kafka-python does not close what a failed constructor opened, and its clients sit in reference cycles: the
socket stayed open until a later garbage collection found it, which then warned inside whatever test ran
(one CI run's failure: an admin client of the compose test, whose broker had not answered in time, collected
in another module's test). A port that accepts and never answers is that broker: the constructor times out
on its API-versions probe (whether its last try is still connected then depends on timing; the owner below
fails while connected, always).
"""

from __future__ import annotations

import gc
import socket
import warnings
from collections.abc import Iterator
from typing import ClassVar

import pytest
from kafka import KafkaAdminClient
from kafka.client_async import KafkaClient
from kafka.errors import NoBrokersAvailable, UnrecognizedBrokerVersion

from shared.bus import new_client

pytestmark = pytest.mark.integration


@pytest.fixture
def silent_port() -> Iterator[tuple[socket.socket, int]]:
    """A listener that accepts connections (the kernel does) and never answers."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=16)
    try:
        yield listener, listener.getsockname()[1]
    finally:
        listener.close()


def _open_connections(listener: socket.socket) -> int:
    """How many of the connections the listener accepted are still open at the client's end: each is read
    until the client closed it (the client wrote its request first) or until it stays silent for a second."""
    listener.settimeout(0.5)
    still_open = 0
    while True:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            return still_open
        with conn:
            conn.settimeout(1)
            try:
                while conn.recv(4096):
                    pass
            except TimeoutError:
                still_open += 1


def _unclosed_sockets_collected() -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gc.collect()
    return [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]


def test_an_admin_client_whose_broker_never_answered_closes_its_connection(
    silent_port: tuple[socket.socket, int],
) -> None:
    listener, port = silent_port
    with pytest.raises(NoBrokersAvailable):
        new_client(lambda: KafkaAdminClient(bootstrap_servers=f"127.0.0.1:{port}", api_version_auto_timeout_ms=1000))
    assert _open_connections(listener) == 0
    assert _unclosed_sockets_collected() == []  # the failure CI saw: a collection that closed a socket


class _Owner:
    """Builds a client, which connects (it probes the broker's versions), then fails: as ``KafkaAdminClient``
    does when finding the controller fails."""

    built: ClassVar[list[_Owner]] = []

    def __init__(self, bootstrap: str) -> None:
        _Owner.built.append(self)
        self._client = KafkaClient(bootstrap_servers=bootstrap)
        raise UnrecognizedBrokerVersion("the controller")


def _connected(client: KafkaClient) -> bool:
    return any(conn.connected() for conn in client._conns.values())


def test_a_client_built_before_its_owners_constructor_failed_is_closed(kafka_bootstrap: str) -> None:
    _Owner.built.clear()
    with pytest.raises(UnrecognizedBrokerVersion):
        new_client(lambda: _Owner(kafka_bootstrap))
    [owner] = _Owner.built
    assert owner._client._closed and not _connected(owner._client)


def test_without_it_the_client_stays_connected(kafka_bootstrap: str) -> None:
    """The control: what kafka-python does alone (if it ever closes by itself, new_client has nothing to do)."""
    _Owner.built.clear()
    with pytest.raises(UnrecognizedBrokerVersion):
        _Owner(kafka_bootstrap)
    [owner] = _Owner.built
    try:
        assert _connected(owner._client) and not owner._client._closed
    finally:
        owner._client.close()
