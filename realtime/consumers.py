"""The consumers a realtime server knows, and their pull logs.

A consumer (of one group, for one subject) is in memory while it is alive or
holds hand-outs; otherwise its state waits in lmdb and is loaded on its next
request (a PULL creates it if lmdb has none). Loads run in a worker thread
(``run_blocking``), one per consumer at a time: a second request for the same consumer waits for the
first load instead of starting another. Each consumer's pull log file records
the consume-log sequences it was handed (one ``pwrite`` on a descriptor kept open,
within ``OPEN_PULL_LOGS``); the pull logs written since the last checkpoint are
fsynced by the next one.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import trio

from delaymq.clock import Clock
from delaymq.protocol.errors import RemoteProtocolError
from delaymq.realtime.caps import DEFAULT_MAX_GROUPS, GroupCap
from delaymq.realtime.checkpoint import consumer_from_record, load_consumer, share_key
from delaymq.realtime.delivery import Picked
from delaymq.realtime.groups import ConsumerState, Groups, Share
from delaymq.realtime.index import Indexer
from delaymq.realtime.pulllog import OPEN_PULL_LOGS, OpenPullLogs, PullLog, consumer_stem, encode_pull_entries
from delaymq.realtime.redelivery import RedeliverySweeper
from delaymq.realtime.requests import PullRequest
from delaymq.storage.errors import storage_refusal
from delaymq.storage.state import StateStore
from delaymq.storage.threads import RunBlocking


@functools.lru_cache(maxsize=4096)
def consumer_key(subject: str, group: str, consumer: str) -> bytes:
    """The key of a consumer's state in memory and in lmdb (its pull log's stem, as bytes;
    remembered for the consumers seen lately: each PULL asks)."""
    return bytes.fromhex(consumer_stem(subject, group, consumer))


class Consumers:
    """Finds, loads and creates consumers; writes what they are handed to their pull logs."""

    def __init__(
        self,
        *,
        groups: Groups,
        indexer: Indexer,
        store: StateStore,
        pull_dir: Path,
        clock: Clock,
        sweeper: RedeliverySweeper,
        run_blocking: RunBlocking,
        open_pull_logs: int = OPEN_PULL_LOGS,
        max_groups: int = DEFAULT_MAX_GROUPS,
    ) -> None:
        self._groups = groups
        #: Shares (a group reading a subject) a PULL may make at most (``caps.GroupCap``).
        self.group_cap = GroupCap(max_groups, groups.shares)
        self._run_blocking = run_blocking
        self._indexer = indexer
        self._store = store
        self._pull_dir = pull_dir
        self._clock = clock
        self._sweeper = sweeper
        self._pull_logs: dict[bytes, PullLog] = {}
        #: The pull logs holding a descriptor (at most ``open_pull_logs``).
        self.open_files = OpenPullLogs(open_pull_logs)
        self._written: set[PullLog] = set()  # pull logs written since the last checkpoint
        self._loading: dict[bytes, trio.Event] = {}

    def find(self, subject: str, group: str, consumer: str) -> ConsumerState | None:
        """The consumer if it is in memory (a heartbeat does not load one)."""
        return self._groups.consumers.get(consumer_key(subject, group, consumer))

    async def get(
        self, subject: str, group: str, consumer: str, *, create: PullRequest | None = None
    ) -> ConsumerState | None:
        """The consumer's state: in memory, loaded from lmdb, or (for a PULL) new."""
        key = consumer_key(subject, group, consumer)
        while True:
            state = self._groups.consumers.get(key)
            if state is not None:
                break
            loading = self._loading.get(key)
            if loading is None:
                break
            await loading.wait()
        if state is None:
            loading = self._loading[key] = trio.Event()
            try:
                state = await self._load(key, subject, group, consumer, create)
            finally:
                del self._loading[key]
                loading.set()
        if state is not None and create is not None and state.broadcast != create.broadcast:
            mode = "broadcast" if state.broadcast else "clustered"
            raise RemoteProtocolError(
                f"PULL: consumer {consumer!r} of group {group!r} reads subject {subject!r} as "
                f"{mode}; broadcast is {create.broadcast} here",
                code="bad_value",
                field="broadcast",
            )
        return state

    async def _load(
        self, key: bytes, subject: str, group: str, name: str, create: PullRequest | None
    ) -> ConsumerState | None:
        pull_log = PullLog(self._pull_dir, key.hex(), files=self.open_files)

        def load() -> tuple[dict[str, Any] | None, tuple[list[int], list[int]]]:
            record = load_consumer(self._store, key)
            if record is None:
                if create is not None:
                    pull_log.truncate(0)  # left by a run that crashed before committing it
                return None, ([], [])
            pull_log.truncate(record["length"])
            return record, pull_log.read(record["acked"], record["length"])

        record, (sequences, redeliveries) = await self._run_blocking(load)
        now = self._clock.monotonic_ms()
        if record is None and create is None:
            return None
        broadcast = record["broadcast"] if record is not None else create.broadcast  # type: ignore[union-attr]
        share = self._share(subject, group, name if broadcast else None, earliest=bool(create and create.earliest))
        if record is not None:
            state = consumer_from_record(key, record, share, sequences, redeliveries)
        else:
            state = ConsumerState(key, subject, group, name, share)
            pull_log.create(subject, group, name, broadcast=broadcast)
            self._written.add(pull_log)
            self._groups.dirty_consumers.add(state)
        self.adopt(state, pull_log, now)
        self._sweeper.poke()
        return state

    def _share(self, subject: str, group: str, broadcast_consumer: str | None, *, earliest: bool) -> Share:
        key = share_key(subject, group, broadcast_consumer)
        share = self._groups.shares.get(key)
        if share is None:
            self.group_cap.check(subject, group, broadcast_consumer)
            position = 0 if earliest else self._indexer.count(subject)
            share = self._groups.add_share(Share(key, subject, group, broadcast_consumer, position))
            self._groups.dirty_shares.add(share)
        return share

    def adopt(self, consumer: ConsumerState, pull_log: PullLog, now: int) -> None:
        """Keep a consumer (loaded, new, or recovered at start-up with hand-outs) in memory."""
        pull_log.files = self.open_files
        self._pull_logs[consumer.key] = pull_log
        self._groups.add_consumer(consumer, now)

    def seen(self, consumer: ConsumerState) -> int:
        """A sign of life from ``consumer``: its timeout starts again. Returns the time."""
        now = self._clock.monotonic_ms()
        self._groups.touch(consumer, now)
        self._sweeper.poke()
        return now

    def record_pull(self, consumer: ConsumerState, picked: list[Picked], now: int) -> int:
        """Hand ``picked`` to ``consumer``: the groups track it, its pull log gets it; returns the pull start."""
        sequences = [item.sequence for item in picked]
        redeliveries = [item.redeliveries for item in picked]
        pull_log = self._pull_logs[consumer.key]
        try:
            # The pull log first: a hand-out it cannot record (a full disk) is no hand-out.
            pull_log.write(consumer.length, encode_pull_entries(sequences, redeliveries))
        except OSError as error:
            # Entries of a write cut short would read as hand-outs after a restart: cut them
            # (shrinking a file needs no space).
            with contextlib.suppress(OSError):
                pull_log.truncate(consumer.length)
            # Back to the front of the share, with the counts they had: nobody received them.
            self._groups.put_back(consumer.share, list(zip(sequences, redeliveries, strict=True)))
            raise storage_refusal("PULL: the pull log could not record the hand-out", error) from error
        self._written.add(pull_log)
        return self._groups.record_pull(consumer, sequences, redeliveries, now)

    # ----------------------------------------------------------- checkpoints

    def take_written(self) -> list[PullLog]:
        """The pull logs written since the last snapshot, for the next one to fsync."""
        written = list(self._written)
        self._written.clear()
        return written

    def restore_written(self, pull_logs: Iterable[PullLog]) -> None:
        """A snapshot failed: its pull logs go into the next one."""
        self._written.update(pull_logs)

    def forget_idle(self) -> None:
        """Drop the consumers that are gone, hold nothing and are committed (reloaded if they come back)."""
        for key in self._groups.forget_idle():
            pull_log = self._pull_logs.pop(key, None)
            if pull_log is not None:
                self.open_files.forget(pull_log)

    def close(self) -> None:
        """Close the pull logs' descriptors (the master stops)."""
        self.open_files.close()


__all__ = ["Consumers", "consumer_key"]
