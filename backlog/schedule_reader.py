"""Spark tasks over a scheduler's files: one hour's files, one message-log segment.

``HourTask`` reads the committed part of one hour (the entries and log bytes the
job's lmdb snapshot counts, nothing a replay step wrote since) and its dispatch log,
and returns per subject: messages still to deliver, their bytes, how many of them are
overdue at the report time, how many were dispatched, and the delay-horizon counts.

``UnfiledTask`` reads a message-log segment from the replay checkpoint on: records
accepted but not yet filed into their hour, counted the same way.

Records are read in order (a schedule log holds its entries' records end to end, so
record ``k`` is entry ``k``), every record's CRC checked; the delay index is read
too, to check it and to skip over a damaged record to the next entry.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from delaymq.backlog import rows
from delaymq.backlog.files import join, open_file, read_whole
from delaymq.backlog.formats import (
    DISPATCH_SUFFIX,
    HOUR_MS,
    INDEX_ENTRY,
    INDEX_ENTRY_SIZE,
    INDEX_SUFFIX,
    LOG_SUFFIX,
    MESSAGE_KIND,
    RECORD_HEADER,
    RECORD_HEADER_SIZE,
    SCHEDULE,
    SCHEDULER_MESSAGES,
    dispatched_bitmap,
    hour_name,
)
from delaymq.backlog.records import RecordScan

_KIND = "scheduler"


class _Tally:
    """Per subject: [messages, bytes, overdue, unfiled, dispatched]; per (subject, bucket): count."""

    __slots__ = ("subjects", "horizon")

    def __init__(self) -> None:
        self.subjects: dict[tuple[bytes, int], list[int]] = {}
        self.horizon: dict[tuple[bytes, int], int] = {}

    def rows(self, group: str) -> list[tuple]:
        out: list[tuple] = []
        for (subject, hour), (messages, size, overdue, unfiled, dispatched) in self.subjects.items():
            out.append((rows.BACKLOG, group, _text(subject), hour, messages, size, overdue, unfiled, dispatched))
        for (subject, bucket), count in self.horizon.items():
            out.append((rows.HORIZON, group, _text(subject), bucket, count))
        return out


def _text(subject: bytes) -> str:
    return subject.decode("utf-8", "replace")


@dataclass(frozen=True, slots=True)
class HourTask:
    """One hour of one scheduler: its committed ``entries`` and ``log_end`` (lmdb snapshot)."""

    group: str
    folder: str  # the scheduler's data folder
    hour: int
    entries: int
    log_end: int
    at_ms: int

    @property
    def files(self) -> int:
        return 3

    def read(self) -> list[tuple]:
        name = hour_name(self.hour)
        schedule = join(self.folder, SCHEDULE)
        problems = rows.Problems(_KIND, self.group)
        tally = _Tally()
        entries = self.entries
        index_name, log_name, dispatch_name = name + INDEX_SUFFIX, name + LOG_SUFFIX, name + DISPATCH_SUFFIX
        try:
            index = read_whole(join(schedule, index_name), limit=entries * INDEX_ENTRY_SIZE)
        except FileNotFoundError:
            index = b""
        if len(index) < entries * INDEX_ENTRY_SIZE:
            problems.add(
                f"{schedule}/{index_name}",
                len(index),
                f"delay index ends at byte {len(index)}; the committed summary counts {entries} entries "
                f"({entries * INDEX_ENTRY_SIZE} bytes)",
            )
        located = _check_index(index, entries, problems, f"{schedule}/{index_name}")
        try:
            bitmap, valid, why = dispatched_bitmap(read_whole(join(schedule, dispatch_name)))
            if why:
                problems.add(
                    f"{schedule}/{dispatch_name}", valid, f"dispatch log {why}; later entries count as not dispatched"
                )
        except FileNotFoundError:  # nothing of the hour dispatched yet (the first dispatch creates it)
            bitmap = bytearray()
        try:
            log = open_file(join(schedule, log_name))
        except FileNotFoundError:
            problems.add(f"{schedule}/{log_name}", 0, "schedule log is missing")
            log = None
        try:
            k = 0
            offset = 0
            while k < entries and log is not None:
                scan = RecordScan(log, offset, self.log_end)
                k = self._tally_records(scan, k, bitmap, tally)
                if k >= entries:
                    break
                problems.add(f"{schedule}/{log_name}", scan.end, f"schedule log: entry {k}'s record: {scan.problem}")
                # Skip to the next entry the index can place after the damage.
                self._unreadable(tally, k, located, bitmap)
                k += 1
                while k < entries and _cannot_place(located[k], scan.end, log.size):
                    self._unreadable(tally, k, located, bitmap)
                    k += 1
                if k < entries:
                    offset = located[k][0]  # type: ignore[index]
            if log is None:
                for n in range(entries):
                    self._unreadable(tally, n, located, bitmap)
        finally:
            if log is not None:
                log.close()
        return tally.rows(self.group) + problems.rows()

    def _tally_records(self, scan: RecordScan, k: int, bitmap: bytearray, tally: _Tally) -> int:
        """Count the records ``scan`` yields as entries ``k``, ``k + 1``, ...; the next ``k``."""
        entries, hour, at = self.entries, self.hour, self.at_ms
        unpack = RECORD_HEADER.unpack_from
        subjects, horizon = tally.subjects, tally.horizon
        bucket_of = rows.horizon_bucket
        width = len(bitmap)
        for _offset, buf, span in scan:
            start = span.start
            (_p, _m, _v, kind, _c, deliver_at, created_at, _a, id_len, subject_len, *_rest) = unpack(buf, start)
            if kind != MESSAGE_KIND:
                subject = rows.UNREADABLE.encode()
            else:
                first = start + RECORD_HEADER_SIZE + id_len
                subject = buf[first : first + subject_len]
            key = (subject, hour)
            counts = subjects.get(key)
            if counts is None:
                counts = subjects[key] = [0, 0, 0, 0, 0]
            if (k >> 3) < width and bitmap[k >> 3] >> (k & 7) & 1:
                counts[4] += 1
            else:
                counts[0] += 1
                counts[1] += span.end - start
                if deliver_at <= at:
                    counts[2] += 1
            bucket = (subject, bucket_of(deliver_at - created_at))
            horizon[bucket] = horizon.get(bucket, 0) + 1
            k += 1
            if k >= entries:
                break
        return k

    def _unreadable(self, tally: _Tally, k: int, located: list[tuple[int, int, int] | None], bitmap: bytearray) -> None:
        """Count entry ``k``, whose record cannot be read, under ``rows.UNREADABLE``."""
        place = located[k] if k < len(located) else None
        ms, size = (place[2], place[1]) if place is not None else (0, 0)
        key = (rows.UNREADABLE.encode(), self.hour)
        counts = tally.subjects.setdefault(key, [0, 0, 0, 0, 0])
        if (k >> 3) < len(bitmap) and bitmap[k >> 3] >> (k & 7) & 1:
            counts[4] += 1
        else:
            counts[0] += 1
            counts[1] += size
            if self.hour * HOUR_MS + ms <= self.at_ms:
                counts[2] += 1


def _check_index(index: bytes, entries: int, problems: rows.Problems, where: str) -> list[tuple[int, int, int] | None]:
    """``(offset, size, ms_in_hour)`` of each committed entry, None where it fails its CRC."""
    located: list[tuple[int, int, int] | None] = [None] * entries
    crc32 = zlib.crc32
    view = memoryview(index)
    for n, (offset, size, ms, _prev, _source, crc) in enumerate(INDEX_ENTRY.iter_unpack(view[: len(index) // 32 * 32])):
        p = n * INDEX_ENTRY_SIZE
        if crc32(view[p : p + 28]) != crc or ms >= HOUR_MS:
            problems.add(where, p, f"delay index entry {n} fails its CRC")
            continue
        located[n] = (offset, size, ms)
    return located


@dataclass(frozen=True, slots=True)
class UnfiledTask:
    """Records of a scheduler's message log at or after the replay checkpoint: accepted, not yet filed."""

    group: str
    folder: str
    segment: str  # file name in messages/
    base: int  # the segment's first offset
    start: int  # where to start in the segment (the checkpoint, or 0)
    stop: int  # the segment's size when the job listed it
    last: bool  # the newest segment (its tail may be being written)
    at_ms: int

    @property
    def files(self) -> int:
        return 1

    def read(self) -> list[tuple]:
        where = join(self.folder, SCHEDULER_MESSAGES, self.segment)
        problems = rows.Problems(_KIND, self.group)
        tally = _Tally()
        try:
            reader = open_file(where)
        except FileNotFoundError:
            problems.add(
                where, self.base + self.start, "message-log segment deleted while the job ran (filed meanwhile)"
            )
            return problems.rows()
        unpack = RECORD_HEADER.unpack_from
        at = self.at_ms
        try:
            scan = RecordScan(reader, self.start, self.stop)
            for _offset, buf, span in scan:
                start = span.start
                (_p, _m, _v, kind, _c, deliver_at, created_at, _a, id_len, subject_len, *_rest) = unpack(buf, start)
                if kind != MESSAGE_KIND:
                    continue
                first = start + RECORD_HEADER_SIZE + id_len
                subject = buf[first : first + subject_len]
                hour = (deliver_at if deliver_at > 0 else created_at) // HOUR_MS
                counts = tally.subjects.setdefault((subject, hour), [0, 0, 0, 0, 0])
                counts[0] += 1
                counts[1] += span.end - start
                counts[3] += 1
                if deliver_at <= at:
                    counts[2] += 1
                bucket = (subject, rows.horizon_bucket(deliver_at - created_at))
                tally.horizon[bucket] = tally.horizon.get(bucket, 0) + 1
            if scan.problem and not (scan.torn and self.last):
                problems.add(where, self.base + scan.end, f"message log: {scan.problem}")
        finally:
            reader.close()
        return tally.rows(self.group) + problems.rows()


def _cannot_place(where: tuple[int, int, int] | None, damage_end: int, log_size: int) -> bool:
    """Whether an index entry's record lies inside the damage (or past the log), so it cannot be read."""
    return where is None or where[0] < damage_end or where[0] >= log_size


__all__ = ["HourTask", "UnfiledTask"]
