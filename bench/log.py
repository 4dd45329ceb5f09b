"""Append-rate benchmark of the segmented log through ``LogWriter``.

100-byte records (12-byte envelope header + 88-byte payload) in batches of 1, 100
and 1,000, under the ``sync`` and ``async`` flush policies. Batch-1 runs once with
a single appender (each append waits for its own write) and once with many
concurrent appenders, which is where group commit shows. It returns figures and
prints nothing; the caller (a CLI command) shows them.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import trio

from delaymq.protocol.envelope import HEADER_SIZE, RecordKind, encode
from delaymq.storage.log import SegmentedLog
from delaymq.storage.writer import FlushPolicy, open_log_writer

RECORD_SIZE = 100
_CASES: tuple[tuple[FlushPolicy, int, int], ...] = (
    # (policy, records per batch, concurrent appenders)
    ("sync", 1, 1),
    ("sync", 1, 64),
    ("sync", 100, 1),
    ("sync", 1000, 1),
    ("async", 1, 1),
    ("async", 1, 64),
    ("async", 100, 1),
    ("async", 1000, 1),
)


def bench_log_append(
    directory: str | os.PathLike[str], *, seconds_per_case: float = 3.0, appenders: int = 64
) -> list[tuple[str, float, str]]:
    """Measure append rates; returns ``(case, value, unit)`` rows. Prints nothing.

    Each case writes a fresh log under ``directory`` and deletes it afterwards.
    ``appenders`` replaces the 64 concurrent tasks of the batch-1 group-commit cases.
    """
    rows: list[tuple[str, float, str]] = []
    record = encode(RecordKind.OPAQUE, bytes(RECORD_SIZE - HEADER_SIZE))
    for policy, batch, tasks in _CASES:
        tasks = appenders if tasks > 1 else 1
        folder = Path(directory) / f"bench-{policy}-b{batch}-t{tasks}"
        shutil.rmtree(folder, ignore_errors=True)
        try:
            with SegmentedLog.open(folder, segment_size=256 << 20) as log:
                records, seconds, fsyncs = trio.run(
                    _run_case, log, policy, record * batch, batch, tasks, seconds_per_case
                )
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        case = f"log append {policy} batch={batch} appenders={tasks}"
        rows.append((case, records / seconds, "records/s"))
        rows.append((case, records * RECORD_SIZE / seconds / 1e6, "MB/s"))
        rows.append((case, fsyncs / seconds, "fsyncs/s"))
    return rows


async def _run_case(
    log: SegmentedLog, policy: FlushPolicy, data: bytes, batch: int, tasks: int, seconds: float
) -> tuple[int, float, int]:
    written = 0
    start = trio.current_time()
    deadline = start + seconds
    async with open_log_writer(log, flush=policy) as writer:

        async def appender() -> None:
            nonlocal written
            while True:  # at least one append per task: a slow start still measures something
                await writer.append(data)
                written += batch
                if trio.current_time() >= deadline:
                    break

        async with trio.open_nursery() as nursery:
            for _ in range(tasks):
                nursery.start_soon(appender)
    # Closing the writer is counted: under async it holds the final fsync.
    elapsed = trio.current_time() - start
    return written, elapsed, writer.statistics().fsyncs
