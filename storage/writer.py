"""The trio side of a log: group commit under a ``sync`` or ``async`` flush policy.

Appenders never touch the disk themselves. They join the open *group* (a list of
batches waiting to be written) and wait; one committer task takes a whole group,
writes it with one ``pwrite`` in a worker thread (``run_blocking``) and, under the
``sync`` policy, fsyncs it in the same call before waking every appender of the
group. While that thread works the next group fills up, so the more appenders
arrive together, the fewer writes and fsyncs each costs (RocketMQ's
GroupCommitService, in one task).

Under ``async`` an append returns once written, and a background task fsyncs
every ``flush_interval_ms`` and once more on close.

A failed write or fsync reaches every appender of the group as ``AppendFailed``
(its ``__cause__`` is the log's error). Under ``sync`` the group's bytes are then
cut from the log (nobody was told of them), so the next group is appended as if
the failed one never came: a full disk refuses appends while it lasts and the
writer takes them again once space is freed, with one log line per outage.
Under ``async`` a failed background fsync makes every later append fail and is
raised again when the writer closes: never silently dropped.

``wait_idle`` and ``wait_durable`` let an owner wait for the writer to settle (a role
change, a handover): the writer task wakes them after each group and each background
fsync, so nobody polls.

Each good fsync's duration (``time.perf_counter_ns`` around it, in the thread that
fsyncs) goes into a ``LatencyHistogram`` of microseconds, recorded back on the trio
side so a reader of ``fsync_durations_us`` never sees it half updated.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import trio

from delaymq.protocol.envelope import encode
from delaymq.protocol.histogram import LatencyHistogram
from delaymq.storage.errors import AppendFailed, LogClosed, RecordTooLarge, StorageError, describe
from delaymq.storage.log import SegmentedLog
from delaymq.storage.threads import RunBlocking, run_in_thread

_logger = logging.getLogger(__name__)

FlushPolicy = Literal["sync", "async"]
DEFAULT_MAX_GROUP_BYTES = 4 << 20
#: Under ``async``, how often the log is fsynced: what a crash may lose, and how far the
#: scheduler's filing (which never passes the fsynced end) lags. At 100 ms filing came in
#: steps of 100 ms of traffic that held the GIL for tens of ms while SCHEDULEs waited;
#: at 20 ms a producer sending flat out got 179,000-186,000 msg/s accepted against
#: 161,000-170,000 (docs/performance.md, "The async flush interval: 20 ms").
DEFAULT_FLUSH_INTERVAL_MS = 20


@dataclass(frozen=True)
class LogWriterStatistics:
    """A snapshot of a writer's counters."""

    policy: str
    appends: int  # appends written (and, under sync, fsynced)
    bytes: int
    failed_appends: int
    writes: int  # pwrite calls, one per group
    fsyncs: int
    max_group_size: int  # most appends one write has carried
    pending: int  # appends waiting for their group
    end_offset: int
    flushed_offset: int


class _Group:
    """Batches that will go to disk in one write, and the event their appenders wait on."""

    __slots__ = ("parts", "size", "count", "done", "base", "error")

    def __init__(self) -> None:
        self.parts: list[bytes | bytearray | memoryview] = []
        self.size = 0
        self.count = 0
        self.done = trio.Event()
        self.base = -1
        self.error: BaseException | None = None


class LogWriter:
    """Appends to a ``SegmentedLog`` from trio tasks. Build it with ``open_log_writer``."""

    def __init__(
        self,
        log: SegmentedLog,
        *,
        policy: FlushPolicy,
        flush_interval_ms: int,
        max_group_bytes: int,
        run_blocking: RunBlocking,
    ) -> None:
        self._log = log
        self._run_blocking = run_blocking
        self._policy = policy
        self._interval = flush_interval_ms / 1000
        self._max_group_bytes = max_group_bytes
        self._groups: deque[_Group] = deque()
        self._work = trio.Event()
        self._closing = trio.Event()
        self._drained = trio.Event()
        self._failure: BaseException | None = None
        self._appends = 0
        self._bytes = 0
        self._failed_appends = 0
        self._writes = 0
        self._fsyncs = 0
        self._max_group = 0
        self._pending = 0
        self._fsync_us = LatencyHistogram()  # durations of good fsyncs, microseconds
        #: Made by a waiter (``_settled``), set and dropped by the writer task after each group
        #: or background fsync: no event is made per append while nobody waits.
        self._news: trio.Event | None = None
        self._refused_in_outage: int | None = None  # appends failed since the last good write (an outage)

    @property
    def log(self) -> SegmentedLog:
        return self._log

    @property
    def policy(self) -> FlushPolicy:
        return self._policy

    async def append(self, data: bytes | bytearray | memoryview) -> int:
        """Append whole records (a checked batch); returns the offset of its first byte.

        Returns once the batch is written, and under ``sync`` once it is fsynced.
        If the caller is cancelled while waiting, the batch may or may not be in
        the log.
        """
        size = len(data)
        if size == 0:
            raise ValueError("data is empty: append takes one or more whole records")
        if self._closing.is_set():
            raise LogClosed(f"writer of log {self._log.directory} is closed")
        if self._failure is not None:
            raise AppendFailed(
                f"log {self._log.directory} refuses appends: a background fsync failed ({self._failure})"
            ) from self._failure
        groups = self._groups
        if groups and groups[-1].size + size <= self._max_group_bytes:
            group = groups[-1]
        else:
            group = _Group()
            groups.append(group)
        position = group.size
        group.parts.append(data)
        group.size += size
        group.count += 1
        self._pending += 1
        self._work.set()
        await group.done.wait()
        if group.error is not None:
            raise AppendFailed(
                f"append of {size} bytes to log {self._log.directory} failed: {group.error}"
            ) from group.error
        return group.base + position

    async def append_record(self, kind: int, payload: bytes | bytearray | memoryview) -> int:
        """Wrap one payload in an envelope and append it."""
        if len(payload) > self._log.max_record:
            raise RecordTooLarge(f"record payload of {len(payload)} bytes exceeds max_record {self._log.max_record}")
        return await self.append(encode(kind, payload))

    def statistics(self) -> LogWriterStatistics:
        return LogWriterStatistics(
            policy=self._policy,
            appends=self._appends,
            bytes=self._bytes,
            failed_appends=self._failed_appends,
            writes=self._writes,
            fsyncs=self._fsyncs,
            max_group_size=self._max_group,
            pending=self._pending,
            end_offset=self._log.end_offset,
            flushed_offset=self._log.flushed_offset,
        )

    async def wait_idle(self) -> None:
        """Return once no append waits for its group or its write (what was queued is in the log)."""
        while self._pending:
            await self._settled()

    async def wait_durable(self) -> None:
        """``wait_idle``, and the log fsynced up to its end (under ``async`` the background
        fsync gets there within ``flush_interval_ms``)."""
        log = self._log
        while self._pending or log.flushed_offset < log.end_offset:
            await self._settled()

    async def _settled(self) -> None:
        """Wait for the writer task's next group or background fsync."""
        if self._news is None:
            self._news = trio.Event()
        await self._news.wait()

    def _tell_waiters(self) -> None:
        news = self._news
        if news is not None:
            self._news = None
            news.set()

    def fsync_durations_us(self) -> dict[str, Any]:
        """How long each good fsync took, in microseconds (``LatencyHistogram.to_wire``)."""
        return self._fsync_us.to_wire()

    # ------------------------------------------------------------ background

    async def _commit_loop(self) -> None:
        groups = self._groups
        while True:
            if not groups:
                if self._closing.is_set():
                    self._drained.set()
                    return
                self._work = trio.Event()
                await self._work.wait()
                continue
            group = groups.popleft()
            data = group.parts[0] if len(group.parts) == 1 else b"".join(group.parts)
            group.parts = []
            write = self._write_and_flush if self._policy == "sync" else self._write
            try:
                # Not abandoned on cancel: the thread finishes and the group learns
                # its fate either way.
                group.base, fsync_ns = await self._run_blocking(partial(write, data))
            except Exception as error:
                group.error = error
                self._failed_appends += group.count
                self._note_failure(error, group.count)
            else:
                if fsync_ns >= 0:
                    self._fsync_us.record(fsync_ns // 1000)
                self._appends += group.count
                self._bytes += group.size
                self._max_group = max(self._max_group, group.count)
                self._note_success()
            finally:
                self._pending -= group.count
                group.done.set()
                self._tell_waiters()

    def _write(self, data: bytes | bytearray | memoryview) -> tuple[int, int]:
        """Write a group (worker thread); returns its offset and -1 (no fsync)."""
        offset = self._log.append(data)
        self._writes += 1
        return offset, -1

    def _write_and_flush(self, data: bytes | bytearray | memoryview) -> tuple[int, int]:
        """Write and fsync a group (worker thread); returns its offset and the fsync's nanoseconds."""
        try:
            offset, _ = self._write(data)
            started = time.perf_counter_ns()
            self._log.flush()
            elapsed = time.perf_counter_ns() - started
        except Exception:
            # A failed write cut itself back. After a failed fsync the log refuses
            # appends: nobody was told of the bytes past the last good flush, so cut
            # them and go on from there (if even that fails, the next group tries again).
            if self._log.failed:
                try:
                    self._log.drop_unflushed()
                except (StorageError, OSError):
                    pass
            raise
        self._fsyncs += 1
        return offset, elapsed

    def _note_failure(self, error: BaseException, count: int) -> None:
        if self._refused_in_outage is None:
            self._refused_in_outage = 0
            _logger.warning(
                "log %s: appends fail: %s; each is refused until a write succeeds",
                self._log.directory,
                describe(error),
            )
        self._refused_in_outage += count

    def _note_success(self) -> None:
        if self._refused_in_outage is not None:
            _logger.info(
                "log %s: appends succeed again (%d refused meanwhile)", self._log.directory, self._refused_in_outage
            )
            self._refused_in_outage = None

    async def _flush_loop(self) -> None:
        while not self._closing.is_set() and self._failure is None:
            with trio.move_on_after(self._interval):
                await self._closing.wait()
            await self._flush_once()
        await self._drained.wait()
        with trio.CancelScope(shield=True):
            await self._flush_once()

    async def _flush_once(self) -> None:
        log = self._log
        if self._failure is not None or log.flushed_offset >= log.end_offset:
            self._tell_waiters()  # the log may have been fsynced by its other owners (a checkpoint)
            return
        try:
            elapsed = await self._run_blocking(partial(_timed_flush, log))
        except Exception as error:
            self._failure = error
        else:
            self._fsyncs += 1
            self._fsync_us.record(elapsed // 1000)
        self._tell_waiters()

    def _begin_close(self) -> None:
        self._closing.set()
        self._work.set()


def _timed_flush(log: SegmentedLog) -> int:
    """fsync ``log`` (worker thread); returns how many nanoseconds it took."""
    started = time.perf_counter_ns()
    log.flush()
    return time.perf_counter_ns() - started


@asynccontextmanager
async def open_log_writer(
    log: SegmentedLog,
    *,
    flush: FlushPolicy = "sync",
    flush_interval_ms: int = DEFAULT_FLUSH_INTERVAL_MS,
    max_group_bytes: int = DEFAULT_MAX_GROUP_BYTES,
    run_blocking: RunBlocking = run_in_thread,
) -> AsyncIterator[LogWriter]:
    """Run a ``LogWriter`` over ``log`` for the duration of the block.

    ``flush="sync"``: each append returns after the fsync covering it (group
    commit). ``flush="async"``: after the write; fsync every ``flush_interval_ms``.
    ``max_group_bytes`` caps one write (a single bigger batch still goes alone).
    ``run_blocking`` runs the writes and fsyncs (default: a worker thread).
    On exit, waiting appends are written and, under ``async``, flushed. The log
    stays open: its owner closes it.
    """
    if flush not in ("sync", "async"):
        raise ValueError(f"flush must be 'sync' or 'async', got {flush!r}")
    if flush_interval_ms <= 0:
        raise ValueError(f"flush_interval_ms must be positive, got {flush_interval_ms}")
    if max_group_bytes <= 0:
        raise ValueError(f"max_group_bytes must be positive, got {max_group_bytes}")
    writer = LogWriter(
        log,
        policy=flush,
        flush_interval_ms=flush_interval_ms,
        max_group_bytes=max_group_bytes,
        run_blocking=run_blocking,
    )
    body_error: Exception | None = None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(writer._commit_loop)
        if flush == "async":
            nursery.start_soon(writer._flush_loop)
        try:
            yield writer
        except Exception as error:
            # Raised again below, outside the nursery, so the caller sees its own
            # exception rather than an ExceptionGroup around it.
            body_error = error
        finally:
            writer._begin_close()
    if body_error is not None:
        raise body_error
    if writer._failure is not None:
        raise AppendFailed(
            f"a background fsync of log {log.directory} failed; records appended after "
            f"offset {log.flushed_offset} may be lost: {writer._failure}"
        ) from writer._failure
