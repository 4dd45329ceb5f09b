"""Replay: copy message-log records into the schedule logs of their delivery hours.

The message log (a ``SegmentedLog`` of received batches) is the write-ahead log and
the durability point. A replay step reads it from the store's checkpoint, never past
``flushed_offset`` (so nothing filed can vanish from the message log in a power cut,
and a re-run files the same records into the same entry numbers), stages every
record into its hour (``ScheduleStore.stage``), and commits: schedule logs and
indexes fsynced, then the hours' entry counts, the new checkpoint and the heads
journal in one lmdb transaction, then the heads tables.

Idempotent: a crash anywhere in a step leaves the checkpoint where it was; the next
step reads the same records again and the store skips each one its hour already
holds. Blocking: the server runs steps through its ``run_blocking``, one at a time.
``unfiled`` says what replay has yet to file (STATUS).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from delaymq.protocol.envelope import HEADER, HEADER_SIZE
from delaymq.scheduler.hours import ReplayGap
from delaymq.scheduler.schedulelog import ScheduleStore
from delaymq.scheduler.staging import HourArrivals, ReplayStep
from delaymq.storage.errors import OffsetDeleted
from delaymq.storage.log import SegmentedLog

#: Message-log bytes one step reads at most (one fsync round per step).
DEFAULT_STEP_BYTES = 8 << 20
#: ``unfiled`` counts the records of this many bytes at most, and estimates the rest.
UNFILED_COUNT_BYTES = 4 << 20
_CHUNK_BYTES = 1 << 20
#: What the scheduler's message log keeps of its newest appends in memory
#: (``SegmentedLog.keep_recent``): replay, a few milliseconds behind, files them from there.
REPLAY_RECENT_BYTES = 16 << 20


def replay_step(
    log: SegmentedLog,
    store: ScheduleStore,
    *,
    max_bytes: int = DEFAULT_STEP_BYTES,
    until: int | None = None,
) -> ReplayStep:
    """File the next records after ``store.checkpoint``, up to ``max_bytes`` of them (at
    least one record) and never past ``log.flushed_offset`` (or ``until``, a record
    boundary), and commit. A step also ends early once it has touched the store's
    ``max_step_hours`` hours. Returns what was filed; ``step.idle`` (checkpoint
    unchanged) means replay is caught up. ``filed == 0`` alone does not: a step may
    only skip records filed before a crash.
    """
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be at least 1, got {max_bytes}")
    start = store.checkpoint
    end = log.flushed_offset if until is None else min(until, log.flushed_offset)
    if start > log.end_offset:
        raise ReplayGap(
            f"checkpoint {start} is past the end of the message log ({log.end_offset}): "
            "the message log lost records that were filed"
        )
    if start < log.start_offset and start < end:
        raise ReplayGap(
            f"checkpoint {start} lies before the message log's first offset {log.start_offset}: "
            "records that were never filed were deleted"
        )
    position = start
    try:
        while position < end and position - start < max_bytes:
            budget = min(_CHUNK_BYTES, max(max_bytes - (position - start), 1))
            # What this process appended lately is in memory, written by it: no read, no CRC again.
            buf = log.read_recent_whole(position, end, budget) or log.read_raw(position, budget)[0]
            if not buf or (position > start and position - start + len(buf) > max_bytes):
                break  # the end, or a batch that would take the step past max_bytes: the next step's
            stop = min(len(buf), end - position)
            consumed = store.stage(buf, position, stop)
            position += consumed
            if consumed < stop:
                break  # the step touched max_step_hours hours
    except OffsetDeleted as error:
        store.abort()
        raise ReplayGap(f"replay from {start}: {error}") from error
    except BaseException:
        store.abort()
        raise
    if position == start:
        return _idle(start)
    return store.commit(position)


def replay_until_caught_up(
    log: SegmentedLog, store: ScheduleStore, *, max_bytes: int = DEFAULT_STEP_BYTES
) -> ReplayStep:
    """Replay steps until the checkpoint reaches the ``flushed_offset`` seen at the call
    (start-up: before the wheel is built). Returns the steps summed, arrivals merged."""
    target = log.flushed_offset
    steps: list[ReplayStep] = []
    while store.checkpoint < target:
        step = replay_step(log, store, max_bytes=max_bytes, until=target)
        if step.idle:
            break
        steps.append(step)
    return merge_steps(steps, store.checkpoint)


def merge_steps(steps: list[ReplayStep], checkpoint: int) -> ReplayStep:
    """Several consecutive steps as one (arrivals of an hour concatenated)."""
    if not steps:
        return _idle(checkpoint)
    arrivals: dict[int, HourArrivals] = {}
    cancelled: dict[int, list[int]] = {}
    for step in steps:
        for hour, entries in step.cancelled.items():
            cancelled.setdefault(hour, []).extend(entries)
        for hour, got in step.arrivals.items():
            have = arrivals.get(hour)
            if have is None:
                arrivals[hour] = got
            else:
                ms = array("I", have.ms_in_hour)
                ms.extend(got.ms_in_hour)
                arrivals[hour] = HourArrivals(hour, have.first_entry, ms)
    return ReplayStep(
        start_offset=steps[0].start_offset,
        checkpoint=steps[-1].checkpoint,
        filed=sum(s.filed for s in steps),
        already_filed=sum(s.already_filed for s in steps),
        skipped=sum(s.skipped for s in steps),
        bytes=sum(s.bytes for s in steps),
        arrivals=arrivals,
        new_hours=tuple(sorted({h for s in steps for h in s.new_hours})),
        cancelled=cancelled,
    )


@dataclass(frozen=True, slots=True)
class Unfiled:
    """What replay has yet to file: the message log between the checkpoint and its end."""

    bytes: int
    records: int
    exact: bool  # False: ``records`` is estimated from the first ``max_bytes``


def unfiled(log: SegmentedLog, store: ScheduleStore, *, max_bytes: int = UNFILED_COUNT_BYTES) -> Unfiled:
    """Count the records between ``store.checkpoint`` and ``log.end_offset`` (blocking: it reads
    them). Past ``max_bytes`` the rest is estimated from the records counted so far, so a
    member far behind (a slave catching up) answers as fast as one that is not."""
    start, end = store.checkpoint, log.end_offset
    if start >= end:
        return Unfiled(0, 0, True)
    position, records = start, 0
    limit = min(end, start + max_bytes)
    while position < limit:
        buf, after = log.read_raw(position, min(_CHUNK_BYTES, limit - position))
        if not buf:
            break
        records += _count_records(buf)
        position = after
    if position >= end:
        return Unfiled(end - start, records, True)
    counted = position - start
    return Unfiled(end - start, round(records * (end - start) / counted) if counted else 0, False)


def _count_records(buf: bytes) -> int:
    # Whole records the log has checked: walk their size fields.
    count = position = 0
    size = len(buf)
    unpack_size = HEADER.unpack_from
    while position < size:
        position += HEADER_SIZE + unpack_size(buf, position)[0]
        count += 1
    return count


def _idle(offset: int) -> ReplayStep:
    return ReplayStep(start_offset=offset, checkpoint=offset, filed=0, already_filed=0, skipped=0, bytes=0)


__all__ = [
    "DEFAULT_STEP_BYTES",
    "REPLAY_RECENT_BYTES",
    "UNFILED_COUNT_BYTES",
    "ReplayStep",
    "Unfiled",
    "merge_steps",
    "replay_step",
    "replay_until_caught_up",
    "unfiled",
]
