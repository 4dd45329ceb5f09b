"""The registry snapshot in the data folder's lmdb state store: restored at start, and
written after each change worth keeping, before the request that made it is answered,
so what an admin was told is what a restarted metaserver knows."""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path

import trio

from delaymq.metaserver.errors import RegistryError
from delaymq.metaserver.registry import Registry
from delaymq.storage.state import StateStore, pack, unpack
from delaymq.storage.threads import RunBlocking

# One logger name for every metaserver log line, whichever module writes it.
log = logging.getLogger("delaymq.metaserver.server")

#: Where the registry snapshot lives in the data folder's state store.
SNAPSHOT_DB = "metaserver"
SNAPSHOT_KEY = b"registry"


class SnapshotStore:
    """Writes the registry's snapshot when it changed; concurrent changes share one write."""

    def __init__(self, registry: Registry, store: StateStore, run_blocking: RunBlocking) -> None:
        self._registry = registry
        self._store = store
        self._run_blocking = run_blocking
        self._lock = trio.Lock()
        self.snapshots_written = 0

    async def persist(self) -> None:
        """Write the registry snapshot if it changed; concurrent callers share one write."""
        if not self._registry.dirty:
            return
        async with self._lock:
            if not self._registry.dirty:
                return  # the write we waited for covered our change
            changes = self._registry.changes
            data = pack(self._registry.snapshot())
            await self._run_blocking(partial(self._store.put, SNAPSHOT_DB, SNAPSHOT_KEY, data))
            self._registry.mark_persisted(changes)
            self.snapshots_written += 1


def load_registry(
    store: StateStore, now_ms: int, *, evict_after_ms: int, heartbeat_interval_ms: int, failover_after_ms: int
) -> tuple[Registry, int]:
    """The registry restored from the store's snapshot (or a new one), and the snapshot's size.
    Blocking: run it with the store's ``run_blocking``."""
    options = {
        "evict_after_ms": evict_after_ms,
        "heartbeat_interval_ms": heartbeat_interval_ms,
        "failover_after_ms": failover_after_ms,
    }
    data = store.get(SNAPSHOT_DB, SNAPSHOT_KEY)
    if data is None:
        return Registry(**options), 0
    try:
        snapshot = unpack(data)
        registry = Registry.restore(snapshot, now_ms, **options)
    except RegistryError as error:
        raise RegistryError(
            error.field, f"the registry snapshot in {store.directory} cannot be restored: {error}"
        ) from error
    except ValueError as error:  # msgpack's errors for bytes that are not msgpack
        raise RegistryError("snapshot", f"the registry snapshot in {store.directory} is unreadable: {error}") from error
    return registry, len(data)


def log_restored(registry: Registry, data_dir: str | Path, size: int, evict_after_ms: int) -> None:
    """Say what a restart restored, and how long its servers have to heartbeat again."""
    stats = registry.statistics()
    log.info(
        "restored %d servers in %d groups from %s (%d bytes); each has %.1f s to heartbeat",
        stats.servers,
        stats.groups,
        data_dir,
        size,
        evict_after_ms / 1000,
    )


__all__ = ["SNAPSHOT_DB", "SNAPSHOT_KEY", "SnapshotStore", "load_registry", "log_restored"]
