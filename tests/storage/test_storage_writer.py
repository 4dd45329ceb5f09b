"""LogWriter: group commit, flush policies, error propagation, closing."""

from __future__ import annotations

import os
import resource
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from delaymq.protocol.envelope import RecordKind, encode
from delaymq.storage.errors import AppendFailed, LogClosed, LogIOError
from delaymq.storage.log import SegmentedLog
from delaymq.storage.threads import run_inline
from delaymq.storage.writer import DEFAULT_FLUSH_INTERVAL_MS, open_log_writer


def record(task: int, i: int) -> bytes:
    return encode(RecordKind.MESSAGE, f"task-{task:03d}-record-{i:03d}".encode())


@pytest.fixture
def log(tmp_path: Path) -> Iterator[SegmentedLog]:
    with SegmentedLog.open(tmp_path, segment_size=8192) as opened:
        yield opened


async def test_group_commit_many_appenders_each_record_once_and_fewer_fsyncs(tmp_path: Path) -> None:
    acknowledged: dict[int, bytes] = {}
    log = SegmentedLog.open(tmp_path, segment_size=8192)
    async with open_log_writer(log, flush="sync") as writer:

        async def appender(task: int) -> None:
            for i in range(5):
                data = record(task, i)
                offset = await writer.append(data)
                # sync: the append returns only once an fsync covers it
                assert log.flushed_offset >= offset + len(data)
                acknowledged[offset] = data

        async with trio.open_nursery() as nursery:
            for task in range(200):
                nursery.start_soon(appender, task)
        stats = writer.statistics()
    log.close()

    assert len(acknowledged) == 1000
    assert stats.appends == 1000 and stats.failed_appends == 0 and stats.pending == 0
    assert stats.fsyncs == stats.writes < 1000
    assert stats.max_group_size > 1
    assert stats.bytes == sum(len(d) for d in acknowledged.values())
    with SegmentedLog.open(tmp_path, segment_size=8192) as reopened:
        stored = {r.offset: r for r in reopened.iter_from(0)}
        assert len(reopened.segments()) > 1
    assert len(stored) == 1000  # nothing extra, nothing twice
    for offset, data in acknowledged.items():
        assert encode(stored[offset].kind, stored[offset].payload) == data


async def test_a_reader_thread_tailing_the_log_only_ever_sees_whole_records(tmp_path: Path) -> None:
    log = SegmentedLog.open(tmp_path, segment_size=2048)
    total = 50 * 20

    def tail() -> list[bytes]:
        # Runs in its own thread while the writer's thread appends and rolls segments.
        seen: list[bytes] = []
        position = 0
        while len(seen) < total:
            for found in log.iter_from(position, chunk_size=700):
                seen.append(encode(found.kind, found.payload))
                position = found.next_offset
            os.sched_yield()
        return seen

    sent: set[bytes] = set()
    async with trio.open_nursery() as nursery:
        tailed: list[list[bytes]] = []

        async def run_tail() -> None:
            tailed.append(await trio.to_thread.run_sync(tail))

        nursery.start_soon(run_tail)
        async with open_log_writer(log, flush="async") as writer:

            async def appender(task: int) -> None:
                for i in range(20):
                    sent.add(record(task, i))
                    await writer.append(record(task, i))

            async with trio.open_nursery() as appenders:
                for task in range(50):
                    appenders.start_soon(appender, task)
    log.close()
    assert len(tailed[0]) == total
    assert set(tailed[0]) == sent


async def test_async_policy_acknowledges_before_fsync_and_flushes_on_close(log: SegmentedLog) -> None:
    async with open_log_writer(log, flush="async", flush_interval_ms=600_000) as writer:
        offsets = [await writer.append(record(0, i)) for i in range(10)]
        assert offsets == sorted(offsets)
        assert log.flushed_offset == 0 and writer.statistics().fsyncs == 0
    assert log.flushed_offset == log.end_offset == offsets[-1] + len(record(0, 9))
    assert writer.statistics().fsyncs == 1
    assert [r.offset for r in log.iter_from(0)] == offsets


async def test_async_policy_flushes_every_interval(log: SegmentedLog, autojump_clock: trio.abc.Clock) -> None:
    async with open_log_writer(log, flush="async", flush_interval_ms=100) as writer:
        for round_ in range(3):
            target = await writer.append(record(round_, 0)) + len(record(round_, 0))
            # No close, no explicit flush: the background task gets there.
            with trio.fail_after(60):  # virtual time: a lost flush fails instead of hanging
                while log.flushed_offset < target:
                    await trio.sleep(0.01)
    # One fsync per round (each round waited for its own), none left for close.
    assert writer.statistics().fsyncs == 3


async def test_async_policy_fsyncs_within_the_default_interval(
    log: SegmentedLog, autojump_clock: trio.abc.Clock
) -> None:
    """What an ``async`` crash may lose: at most ``DEFAULT_FLUSH_INTERVAL_MS`` of answered appends."""
    async with open_log_writer(log, flush="async", run_blocking=run_inline) as writer:
        for round_ in range(3):
            target = await writer.append(record(round_, 0)) + len(record(round_, 0))
            assert log.flushed_offset < target  # answered before its fsync
            await trio.sleep((DEFAULT_FLUSH_INTERVAL_MS + 1) / 1000)  # the mock clock's time, not a wait for it
            assert log.flushed_offset >= target  # fsynced within the interval of its answer


async def test_batches_keep_their_bytes_together_and_offsets_point_at_them(log: SegmentedLog) -> None:
    async with open_log_writer(log) as writer:
        batches = [b"".join(record(t, i) for i in range(t + 1)) for t in range(20)]
        results: dict[int, int] = {}

        async def send(t: int) -> None:
            results[t] = await writer.append(batches[t])

        async with trio.open_nursery() as nursery:
            for t in range(20):
                nursery.start_soon(send, t)
    for t, offset in results.items():
        assert log.read_raw(offset, len(batches[t]))[0] == batches[t]


async def test_a_failed_write_reaches_every_appender_of_its_group(log: SegmentedLog) -> None:
    before = await trio.to_thread.run_sync(log.append, record(0, 0))
    failures: list[BaseException] = []
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (log.end_offset, hard))  # disk "full" now
    try:
        async with open_log_writer(log, flush="sync") as writer:

            async def appender(task: int) -> None:
                try:
                    await writer.append(record(task, 1))
                except AppendFailed as error:
                    failures.append(error)

            async with trio.open_nursery() as nursery:
                for task in range(10):
                    nursery.start_soon(appender, task)
            assert writer.statistics().failed_appends == 10
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous_handler)
    assert len(failures) == 10
    assert all(isinstance(f.__cause__, LogIOError) for f in failures)
    assert "failed" in str(failures[0])
    # Nothing of the failed group is in the log, and the log carries on.
    assert log.end_offset == before + len(record(0, 0))
    async with open_log_writer(log) as writer:
        assert await writer.append(record(0, 2)) == log.end_offset - len(record(0, 2))


async def test_appending_after_close_is_refused(log: SegmentedLog) -> None:
    async with open_log_writer(log) as writer:
        await writer.append(record(0, 0))
    with pytest.raises(LogClosed, match="closed"):
        await writer.append(record(0, 1))


async def test_an_error_in_the_block_comes_out_as_itself(log: SegmentedLog) -> None:
    with pytest.raises(KeyError):
        async with open_log_writer(log) as writer:
            await writer.append(record(0, 0))
            raise KeyError("boom")
    assert log.end_offset == len(record(0, 0))


async def test_bad_options_are_refused_by_name(log: SegmentedLog) -> None:
    with pytest.raises(ValueError, match="flush must be 'sync' or 'async'"):
        async with open_log_writer(log, flush="sometimes"):  # type: ignore[arg-type]
            pass
    with pytest.raises(ValueError, match="flush_interval_ms must be positive"):
        async with open_log_writer(log, flush="async", flush_interval_ms=0):
            pass
