"""``rein migrate`` on a real Redis: a window left under the layout before the hash tag goes on after it.

The older layout is today's keys under the bare prefix (``rein:window`` for ``{rein}:window``: the
names in ``shared/names.py`` before commit 71c9185, same contents), so the window here is made by
today's store and its keys renamed to the old names: what an older rein left behind.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from ops.cli import main
from ops.migrate import MigrationRefused, migrate, old_name
from services.collector.window_store import WindowLost, WindowStore
from shared.names import RedisKeys, Topics
from shared.schemas import BatchManifest, GroupRef
from shared.staleness import WindowGroup, WindowSettings

pytestmark = pytest.mark.integration

CONFIG = WindowSettings(keep_versions=2, batch_groups=2)


@pytest.fixture
def client(redis_db_url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_db_url, decode_responses=True)
    yield c
    c.close()


def _store(client: redis.Redis, keys: RedisKeys) -> WindowStore:
    return WindowStore(client, keys, Topics(), CONFIG, replica="test")


def _step(store: WindowStore, gid: str) -> int | None:
    """Decide group ``gid`` (signal, on v1); the index of the manifest it completed, if any."""
    group = WindowGroup(gid, f"p-{gid}", 0, False, ("v1", "v1"))
    outcome = store.step(group, GroupRef(group_id=gid, partition=0, offset=0))
    if outcome.result is None:
        return -1
    manifests = [r for _, r in outcome.records if isinstance(r, BatchManifest)]
    return manifests[0].index if manifests else None


def _old_run(client: redis.Redis) -> tuple[RedisKeys, dict[str, bytes]]:
    """A window with a batch made, a group pending, records in the outbox and a prompt cursor, under the old
    names; returns its keys and each key's contents (DUMP) by new name."""
    keys = RedisKeys(f"m{uuid.uuid4().hex[:8]}")
    store = _store(client, keys)
    store.claim_config()
    store.registry.publish("v0", 0)
    store.registry.publish("v1", 1)
    assert [_step(store, "g0"), _step(store, "g1"), _step(store, "g2")] == [None, 0, None]
    client.set(keys.prompt_cursor("guess_number", 0), 37)
    tagged = sorted(str(k) for k in client.scan_iter(match=keys.tag.replace("{", "[{]").replace("}", "[}]") + ":*"))
    dumps: dict[str, bytes] = {k: client.dump(k) for k in tagged}  # type: ignore[misc]
    for key in tagged:
        client.rename(key, old_name(keys, key))
    return keys, dumps


def test_a_window_under_the_old_layout_moves_whole_and_goes_on(client: redis.Redis) -> None:
    keys, before = _old_run(client)
    with pytest.raises(WindowLost, match="rein migrate"):
        _store(client, keys).claim_config()

    planned = migrate(client, keys, dry_run=True)
    assert sorted(planned.moved) == sorted(before) and not planned.done
    assert not any(client.exists(k) for k in before), "a dry run changes nothing"

    done = migrate(client, keys)
    assert sorted(done.moved) == sorted(before)
    assert done.moved[-1] == keys.window_config, "the window's settings move last"
    assert {k: client.dump(k) for k in before} == before, "every key moved whole"
    assert not any(client.exists(old_name(keys, k)) for k in before)

    again = migrate(client, keys)
    assert again.moved == [] and again.duplicates == [] and sorted(again.done) == sorted(before)

    store = _store(client, keys)
    store.claim_config()
    assert _step(store, "g1") == -1, "a group decided before the move is not decided again"
    assert _step(store, "g3") == 1, "manifests go on from the index after the last one, with the pending group"
    assert int(client.get(keys.prompt_cursor("guess_number", 0)) or 0) == 37
    assert store.registry.ordered() == [("v0", 0), ("v1", 1)]


def test_it_refuses_and_changes_nothing_when_the_layouts_disagree_or_a_collector_publishes(
    client: redis.Redis,
) -> None:
    keys, _ = _old_run(client)
    client.hset(keys.window, "current", "v9")  # a window under the new names too, and a different one
    with pytest.raises(MigrationRefused, match="different contents"):
        migrate(client, keys)
    assert client.exists(old_name(keys, keys.window_config)) and not client.exists(keys.window_config)
    client.delete(keys.window)

    client.set(old_name(keys, keys.outbox_lock), "token", px=10_000)
    with pytest.raises(MigrationRefused, match="Stop every service"):
        migrate(client, keys)
    assert not client.exists(keys.window_config)


def test_the_command(client: redis.Redis, redis_db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    keys, before = _old_run(client)
    assert main(["migrate", "--redis", redis_db_url, "--key-prefix", keys.prefix, "--dry-run"]) == 0
    assert f"would move {len(before)} keys" in capsys.readouterr().out
    assert main(["migrate", "--redis", redis_db_url, "--key-prefix", keys.prefix]) == 0
    assert f"moved {len(before)} keys" in capsys.readouterr().out
    client.set(old_name(keys, keys.outbox_lock), "token", px=10_000)
    assert main(["migrate", "--redis", redis_db_url, "--key-prefix", keys.prefix]) == 1
    assert "refused" in capsys.readouterr().err
