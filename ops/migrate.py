"""Move a deployment's Redis keys from the layout before the hash tag (``rein:window``) to today's
(``{rein}:window``, :class:`shared.names.RedisKeys`), so a run started by an older rein goes on.

A collector that finds only the old layout refuses to start (``WindowLost``): a fresh window beside
the old one would number manifests from 0 again, which a resumed trainer skips as trained. This is
the way forward. Every durable key moves (the window and its pending groups, ``decided``, the
version registry, the outbox, the prompt cursors), each whole (DUMP, then RESTORE under the new
name and DEL of the old in one transaction), and the window's settings last: until they move, a
collector still refuses, so a half-done migration is never run on. Rerunning it is safe: a moved
key is skipped, and an interrupted run finishes the rest.

It refuses, changing nothing, when a key exists under both names with different contents, or while
the old layout's outbox lease is held (a collector of the older rein is publishing: stop every
service first).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import redis

from shared.names import RedisKeys

FIXED = ("registry", "registry_order", "unregistered", "unregistered_counter", "window", "pending",
         "pending_order", "decided", "decided_at", "outbox")
"""The durable keys with a fixed name; ``window_config`` comes after them, the prompt cursors are found by name."""


class MigrationRefused(RuntimeError):
    """The keys are in a state this command does not resolve by itself; nothing was changed."""


@dataclass
class Migration:
    """What :func:`migrate` found and did, key by key (new names)."""

    moved: list[str] = field(default_factory=list)
    """Moved from the old name (or, with ``dry_run``, to be moved)."""
    duplicates: list[str] = field(default_factory=list)
    """Under both names with the same contents: the old copy deleted (or to be)."""
    done: list[str] = field(default_factory=list)
    """Under the new name only: moved before."""


def old_name(keys: RedisKeys, new: str) -> str:
    """The name ``new`` had before the hash tag: the bare prefix in place of the tagged one."""
    tag = keys.tag
    if tag == keys.prefix:
        raise ValueError(f"key prefix {keys.prefix!r} holds its own hash tag: it never had an untagged layout")
    return keys.prefix + new[len(tag):]


def _pairs(client: redis.Redis, keys: RedisKeys) -> list[tuple[str, str]]:
    """``(old, new)`` for every durable key, the window's settings last."""
    pairs = [(old_name(keys, new), new) for new in (getattr(keys, name) for name in FIXED)]
    start = old_name(keys, keys.prompt_cursors)
    names = {str(k)[len(start):] for k in client.scan_iter(match=_glob(start) + "*", count=1000)}
    names |= {str(k)[len(keys.prompt_cursors):]
              for k in client.scan_iter(match=_glob(keys.prompt_cursors) + "*", count=1000)}
    pairs += [(start + name, keys.prompt_cursors + name) for name in sorted(names)]
    pairs.append((old_name(keys, keys.window_config), keys.window_config))
    return pairs


def _glob(text: str) -> str:
    """``text`` as a literal in a SCAN pattern."""
    return "".join(f"[{c}]" if c in "*?[]\\" else c for c in text)


def migrate(client: redis.Redis, keys: RedisKeys, *, dry_run: bool = False) -> Migration:
    """Move ``keys``' deployment to the tagged layout (see the module docstring); idempotent."""
    lease = old_name(keys, keys.outbox_lock)
    if client.exists(lease):
        raise MigrationRefused(f"{lease} is held: a collector of the older rein is publishing its outbox. Stop "
                               "every service of the run first, then migrate.")
    pairs = _pairs(client, keys)
    plan = Migration()
    conflicts = []
    for old, new in pairs:
        has_old, has_new = bool(client.exists(old)), bool(client.exists(new))
        if has_old and has_new:
            if client.dump(old) == client.dump(new):
                plan.duplicates.append(new)
            else:
                conflicts.append(f"{old} and {new}")
        elif has_old:
            plan.moved.append(new)
        elif has_new:
            plan.done.append(new)
    if conflicts:
        raise MigrationRefused("keys under both layouts with different contents (two runs under one prefix?): "
                               + "; ".join(conflicts) + ". Nothing was changed; keep one run's keys and delete "
                               "the other's, or use another REIN_REDIS__KEY_PREFIX for one of them.")
    if dry_run:
        return plan
    todo = {*plan.moved, *plan.duplicates}
    for old, new in pairs:  # in order: the window's settings last
        if new not in todo:
            continue
        with client.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(old)  # type: ignore[no-untyped-call]
                payload, ttl = pipe.dump(old), int(pipe.pttl(old))
                if payload is None:
                    raise redis.WatchError(old)
                pipe.multi()
                if new in plan.moved:
                    pipe.restore(new, max(ttl, 0), payload)
                pipe.delete(old)
                pipe.execute()
            except redis.WatchError as exc:
                raise MigrationRefused(f"{old} changed or went while it was moved: a service of the run is "
                                       "still running. Stop every service, then migrate again (what moved "
                                       "stays moved).") from exc
    return plan
