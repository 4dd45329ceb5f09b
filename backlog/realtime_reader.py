"""Spark tasks over a realtime server's files: one consume log, one pull log, one message-log segment.

Each reads only what the job's lmdb snapshot (the server's last checkpoint) counts:
a consume log's first ``count`` entries, a pull log's entries below the committed
``length``, message-log records below ``index_offset``. So a folder read while its
server runs gives the state of one checkpoint.

- ``ConsumeLogTask``: the subject's stored entries; per share (a consumer group's
  read position, or a broadcast consumer's) how many are not yet handed out, how
  many were given back and wait to be handed out again, and when the oldest waiting
  one was stored; and ``(offset, stored_at)`` of each entry for the lateness join.
- ``PullLogTask``: one consumer's hand-outs not yet acked (``[acked, length)`` less
  the ranges acked out of order), and how many of them are redeliveries.
- ``MessageSegmentTask``: ``(offset, subject, deliver_at)`` of each delayed message
  (``deliver_at`` after ``created_at``; dead letters left out) for the lateness join.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from delaymq.backlog import rows
from delaymq.backlog.files import join, open_file, read_whole
from delaymq.backlog.formats import (
    CONSUME,
    CONSUME_ENTRY,
    CONSUME_ENTRY_SIZE,
    DEAD_PREFIX,
    MESSAGE_KIND,
    PULL,
    PULL_ENTRY,
    PULL_ENTRY_SIZE,
    REALTIME_MESSAGES,
    RECORD_HEADER,
    RECORD_HEADER_SIZE,
    entry_time,
    subject_stem,
)
from delaymq.backlog.records import RecordScan

_KIND = "realtime"


@dataclass(frozen=True, slots=True)
class ShareState:
    """One share of a subject as the checkpoint left it."""

    group: str
    broadcast_consumer: str  # "" for a clustered group
    position: int
    skip: tuple[int, ...]
    redeliver: tuple[int, ...]  # consume-log sequences given back


@dataclass(frozen=True, slots=True)
class ConsumeLogTask:
    group: str
    folder: str
    stem: str
    subject: str  # from the checkpoint's shares, "" when no share names it
    count: int  # committed entries
    shares: tuple[ShareState, ...]

    @property
    def files(self) -> int:
        return 1

    def read(self) -> list[tuple]:
        consume = join(self.folder, CONSUME)
        problems = rows.Problems(_KIND, self.group)
        subject = self.subject
        try:
            named = read_whole(join(consume, self.stem + ".name")).decode("utf-8")
            if subject_stem(named) == self.stem:
                subject = named
            else:
                problems.add(f"{consume}/{self.stem}.name", 0, f"names subject {named!r}, whose file is not this one")
        except (FileNotFoundError, UnicodeDecodeError):
            problems.add(f"{consume}/{self.stem}.name", 0, "subject name file is missing or not UTF-8")
        subject = subject or f"(consume log {self.stem})"
        where = f"{consume}/{self.stem}.log"
        try:
            data = read_whole(join(consume, self.stem + ".log"), limit=self.count * CONSUME_ENTRY_SIZE)
        except FileNotFoundError:
            data = b""
        have = len(data) // CONSUME_ENTRY_SIZE
        if have < self.count:
            problems.add(
                where, len(data), f"consume log ends at byte {len(data)}; the checkpoint counts {self.count} entries"
            )
        stored_at = [-1] * have
        out: list[tuple] = [(rows.STORED, self.group, subject, self.count)]
        crc32 = zlib.crc32
        view = memoryview(data)
        for n, (offset, _size, _mask, at, crc) in enumerate(
            CONSUME_ENTRY.iter_unpack(view[: have * CONSUME_ENTRY_SIZE])
        ):
            p = n * CONSUME_ENTRY_SIZE
            if crc32(view[p : p + 28]) != crc:
                problems.add(where, p, f"consume-log entry {n} fails its CRC")
                continue
            at = entry_time(at)  # (a held entry's: when it may be handed out)
            stored_at[n] = at
            out.append((rows.ENTRY, self.group, offset, at))
        for share in self.shares:
            out.append(_share_row(self.group, subject, share, self.count, stored_at))
        return out + problems.rows()


def _share_row(group: str, subject: str, share: ShareState, count: int, stored_at: list[int]) -> tuple:
    skipped = {s for s in share.skip if share.position <= s < count}
    waiting = max(0, count - share.position) - len(skipped)
    first = share.position
    while first in skipped:
        first += 1
    candidates = [s for s in share.redeliver if s < count]
    if first < count:
        candidates.append(first)
    times = [stored_at[s] for s in candidates if s < len(stored_at) and stored_at[s] >= 0]
    oldest = min(times) if times else None
    redelivery = sum(1 for s in share.redeliver if s < count)
    return (rows.SHARE, group, subject, share.group, share.broadcast_consumer, waiting, redelivery, oldest)


@dataclass(frozen=True, slots=True)
class PullLogTask:
    group: str
    folder: str
    stem: str
    subject: str
    consumer_group: str
    consumer: str
    broadcast: bool
    acked: int
    length: int
    done: tuple[tuple[int, int], ...]  # pull-log ranges acked above ``acked``

    @property
    def files(self) -> int:
        return 1

    def read(self) -> list[tuple]:
        problems = rows.Problems(_KIND, self.group)
        where = join(self.folder, PULL, self.stem + ".log")
        unacked = redelivered = 0
        if self.length > self.acked:
            try:
                reader = open_file(where)
                try:
                    data = reader.read(self.acked * PULL_ENTRY_SIZE, (self.length - self.acked) * PULL_ENTRY_SIZE)
                finally:
                    reader.close()
            except FileNotFoundError:
                data = b""
            if len(data) < (self.length - self.acked) * PULL_ENTRY_SIZE:
                problems.add(where, self.acked * PULL_ENTRY_SIZE + len(data),
                             f"pull log ends before the committed length of {self.length} entries")  # fmt: skip
            done = sorted(self.done)
            view = memoryview(data)
            have = len(data) // PULL_ENTRY_SIZE
            d = 0
            for position in range(self.acked, self.length):
                while d < len(done) and done[d][1] <= position:
                    d += 1
                if d < len(done) and done[d][0] <= position:
                    continue  # acked out of order
                unacked += 1  # an entry the file lacks still counts: the checkpoint says it was handed out
                i = position - self.acked
                if i >= have:
                    continue
                p = i * PULL_ENTRY_SIZE
                _sequence, redeliveries, _reserved, crc = PULL_ENTRY.unpack_from(view, p)
                if zlib.crc32(view[p : p + 12]) != crc:
                    problems.add(where, self.acked * PULL_ENTRY_SIZE + p, f"pull-log entry {position} fails its CRC")
                elif redeliveries:
                    redelivered += 1
        return [
            (
                rows.UNACKED,
                self.group,
                self.subject,
                self.consumer_group,
                self.consumer,
                self.broadcast,
                unacked,
                redelivered,
            ),
            *problems.rows(),
        ]


@dataclass(frozen=True, slots=True)
class MessageSegmentTask:
    """A realtime message-log segment, up to the checkpoint's ``index_offset``."""

    group: str
    folder: str
    segment: str
    base: int
    stop: int  # bytes of the segment below index_offset

    @property
    def files(self) -> int:
        return 1

    def read(self) -> list[tuple]:
        where = join(self.folder, REALTIME_MESSAGES, self.segment)
        problems = rows.Problems(_KIND, self.group)
        try:
            reader = open_file(where)
        except FileNotFoundError:
            problems.add(where, self.base, "message-log segment deleted while the job ran")
            return problems.rows()
        out: list[tuple] = []
        unpack = RECORD_HEADER.unpack_from
        dead = DEAD_PREFIX.encode()
        base, group = self.base, self.group
        try:
            scan = RecordScan(reader, 0, self.stop)
            for offset, buf, span in scan:
                start = span.start
                (_p, _m, _v, kind, _c, deliver_at, created_at, _a, id_len, subject_len, *_rest) = unpack(buf, start)
                if kind != MESSAGE_KIND or deliver_at <= created_at:
                    continue
                first = start + RECORD_HEADER_SIZE + id_len
                subject = buf[first : first + subject_len]
                if subject.startswith(dead):
                    continue
                out.append((rows.RECORD, group, base + offset, subject.decode("utf-8", "replace"), deliver_at))
            if scan.problem:
                problems.add(where, base + scan.end, f"message log: {scan.problem}")
        finally:
            reader.close()
        return out + problems.rows()


__all__ = ["ConsumeLogTask", "MessageSegmentTask", "PullLogTask", "ShareState"]
