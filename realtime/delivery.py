"""What a PULL hands out, and the bytes it answers with.

``pick`` chooses entries (given-back ones first, then new ones past the share's
position, filtered by tag bitmask, within the message and byte limits) from the
consume-log entries held in memory, and moves the share; entries not held are
read in a worker thread first (``EntriesNotHeld``, ``read_window``; so are those of
a NACK, ``claimed_entries``).
``read_records`` then reads the records from the message log in a worker thread,
adjacent ones in one read, and raises the attempts of redelivered ones;
``read_intact`` leaves out records that do not check (a damaged message log).
Records stored lately come from memory instead (``read_recent_records``): no
thread, no file read.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import NamedTuple

from delaymq.protocol.records import raise_attempts
from delaymq.realtime.consumelog import (
    ENTRY_SIZE,
    TAIL_ENTRIES,
    ConsumeLog,
    decode_entry,
    held_until,
    iter_entries,
)
from delaymq.realtime.groups import Groups, Share
from delaymq.storage.errors import BadOffset, CorruptLog
from delaymq.storage.log import SegmentedLog
from delaymq.storage.threads import RunBlocking

log = logging.getLogger(__name__)

#: Consume-log entries read at a time, and scanned at most by one ``pick`` (a tag
#: filter may skip many; the caller lets other tasks run and picks again).
READ_ENTRIES = 1024
SCAN_ENTRIES = 64 * 1024


class Picked(NamedTuple):
    """One picked entry: where its record is, and how often it was handed out before."""

    sequence: int  # in the consume log
    redeliveries: int
    offset: int  # of its record in the message log
    size: int  # of its record


class EntriesNotHeld(Exception):
    """``pick`` needs consume-log entries from ``sequence`` on that memory does not hold."""

    def __init__(self, sequence: int) -> None:
        super().__init__(f"consume-log entry {sequence} is not in memory")
        self.sequence = sequence


class Pick(NamedTuple):
    """What ``pick`` chose: ``entries`` to hand out; ``more`` when entries remain unscanned;
    ``held_until`` when it stopped at a new entry not yet due (its time, epoch ms)."""

    entries: list[Picked]
    more: bool
    held_until: int | None = None


def pick(
    consume_log: ConsumeLog | None,
    groups: Groups,
    share: Share,
    limit: int,
    max_bytes: int,
    mask: int,
    now_ms: int,
) -> Pick:
    """Entries to hand out now, and whether entries remain unscanned.

    Never early: new entries are handed out in order up to the first held one
    (``HELD``: a scheduler sent it ahead of its ``deliver_at``) whose time is past
    ``now_ms``; the pick stops there and says until when (``held_until``). So does a
    given-back held entry not due yet (a consumer fetched it ahead, then gave it back),
    new entries still going. A PULL asking ``ahead_ms`` passes the clock that much later
    (its consumer holds them).

    Reads no file: entries come from memory (``ConsumeLog.read_held``); where none it
    needs are held, raises ``EntriesNotHeld`` (the share unchanged but for entries it
    skipped) so the caller reads them in a worker thread and picks again.

    At least one entry is picked when any is available, even one bigger than
    ``max_bytes``. The tag filter (``mask``, 0 for none) skips new entries only:
    a given-back one passed it before. Skipped entries are consumed for the share,
    and so are those in ``share.skip`` (handed out before a crash).
    """
    picked: list[Picked] = []
    if consume_log is None:
        return Pick(picked, False)
    total = 0  # bytes picked
    held: int | None = None  # the earliest moment a held entry the pick stopped at may go
    if share.redeliver:
        total, held, done = _pick_given_back(consume_log, groups, share, picked, limit, max_bytes, now_ms)
        if done:
            return Pick(picked, False)
    # Positional: once per PULL, where keyword arguments cost a little each time.
    return _pick_new(consume_log, groups, share, picked, total, held, limit, max_bytes, mask, now_ms)


class _GivenBack(NamedTuple):
    """What ``pick`` took of a share's given-back entries before its new ones."""

    total: int  # bytes picked
    held: int | None  # when the first given-back entry not due yet may go (epoch ms)
    done: bool  # the pick ends here: the next entry is not in memory, or over ``max_bytes``


def _pick_given_back(
    consume_log: ConsumeLog,
    groups: Groups,
    share: Share,
    picked: list[Picked],
    limit: int,
    max_bytes: int,
    now_ms: int,
) -> _GivenBack:
    """Append the share's given-back entries due by ``now_ms`` to ``picked``; those not
    taken go back to the share (never lose a given-back message)."""
    total = 0
    taken = groups.take_redeliveries(share, limit)
    for index, (sequence, redeliveries) in enumerate(taken):
        if sequence >= consume_log.count:
            # Its record was lost to damage (recovery drops these; never fail a pull).
            log.warning(
                "realtime: group %r on %r: given-back entry %d is past the consume log's %d; dropped",
                share.group,
                share.subject,
                sequence,
                consume_log.count,
            )
            continue
        try:
            entry = consume_log.held_entry(sequence)
        except BaseException:
            groups.put_back(share, taken[index:])
            raise
        if entry is None:  # not in memory: picked as far as it goes, or read it first
            groups.put_back(share, taken[index:])
            if picked:
                return _GivenBack(total, None, True)
            raise EntriesNotHeld(sequence)
        release = held_until(entry.stored_at)
        if release is not None and release > now_ms:
            # Given back before it was due (its consumer had fetched it ahead): it and the
            # given-back ones after it wait until then; new entries may still go.
            groups.put_back(share, taken[index:])
            return _GivenBack(total, release, False)
        if picked and total + entry.size > max_bytes:
            groups.put_back(share, taken[index:])
            return _GivenBack(total, None, True)
        picked.append(Picked(sequence, redeliveries, entry.offset, entry.size))
        total += entry.size
    return _GivenBack(total, None, False)


def _pick_new(
    consume_log: ConsumeLog,
    groups: Groups,
    share: Share,
    picked: list[Picked],
    total: int,
    held: int | None,
    limit: int,
    max_bytes: int,
    mask: int,
    now_ms: int,
) -> Pick:
    """Append new entries past the share's position to ``picked`` (``total`` bytes so far) and
    move the share; ``held``: when a given-back entry not due yet may go (``pick``)."""
    position = share.position
    count = consume_log.count
    skip = share.skip
    scanned = 0
    full = len(picked) >= limit
    while not full and position < count and scanned < SCAN_ENTRIES:
        data = consume_log.read_held(position, min(READ_ENTRIES, count - position))
        if data is None:  # not in memory: picked as far as it goes, or read it first
            if picked:
                break
            groups.advance(share, position)
            raise EntriesNotHeld(position)
        if not data:
            break
        # The per-entry loop stays inline, on locals: a call per entry would cost measurably
        # on a PULL that scans thousands of entries.
        for offset, size, entry_mask, stored_at, _crc in iter_entries(data):  # (time: HELD flag included)
            scanned += 1
            if (mask and not entry_mask & mask) or (skip and position in skip):
                skip.discard(position)  # handed out before a crash: in a pull log already
                position += 1
                continue
            if stored_at > now_ms:  # held (sent ahead), or indexed before the wall clock stepped back
                release = held_until(stored_at)
                if release is not None and release > now_ms:  # it and all behind it wait
                    held = release if held is None else min(held, release)
                    full = True
                    break
            if picked and total + size > max_bytes:
                full = True
                break
            picked.append(Picked(position, 0, offset, size))
            total += size
            position += 1
            if len(picked) >= limit:
                full = True
                break
    groups.advance(share, position)
    return Pick(picked, not picked and held is None and position < count, held)


async def read_window(
    consume_log: ConsumeLog, start: int, *, run_blocking: RunBlocking, hold: Callable[[ConsumeLog], None]
) -> bytes:
    """Read consume-log entries from ``start`` in a worker thread, hold them as the log's
    window (for ``read_held``; ``hold`` bounds the logs holding entries) and return them.

    The thread reads the file by offsets only (``ConsumeLog.read``), below the entries
    written; the window is replaced in the event loop, and not at all if the log forgot
    what it held meanwhile (``generation``)."""
    generation = consume_log.generation
    data = await run_blocking(partial(consume_log.read, start, TAIL_ENTRIES))
    consume_log.hold_window(start, data, generation)
    hold(consume_log)
    return data


async def claimed_entries(
    consume_log: ConsumeLog,
    entries: Iterable[tuple[int, int]],
    *,
    run_blocking: RunBlocking,
    hold: Callable[[ConsumeLog], None],
) -> list[Picked]:
    """``entries`` ((sequence, redeliveries) handed out before, e.g. a NACK's claim) as ``Picked``:
    from memory where held, else from the file in a worker thread (``read_window``), never on
    the event loop. Raises ``IndexError`` for an entry the log no longer has."""
    picked: list[Picked] = []
    window_start, window = 0, b""
    for sequence, redeliveries in entries:
        entry = consume_log.held_entry(sequence)
        if entry is None:
            index = sequence - window_start
            if not 0 <= index < len(window) // ENTRY_SIZE:
                window_start, index = sequence, 0
                window = await read_window(consume_log, sequence, run_blocking=run_blocking, hold=hold)
                if not window:
                    raise IndexError(f"consume log of {consume_log.subject!r} has no entry {sequence}")
            entry = decode_entry(window, index * ENTRY_SIZE)
            if entry is None:
                raise CorruptLog(f"consume log {consume_log.path}: entry {sequence} does not check")
        picked.append(Picked(sequence, redeliveries, entry.offset, entry.size))
    return picked


def read_records(log: SegmentedLog, picked: list[Picked]) -> bytes:
    """The records of ``picked``, in order (blocking: a worker thread)."""
    parts: list[bytes] = []
    for offset, length, redeliveries in _spans(picked):
        data = _read_span(log, offset, length)
        parts.append(raise_attempts(data, redeliveries) if redeliveries else data)
    return b"".join(parts)


def read_recent_records(log: SegmentedLog, picked: list[Picked]) -> bytes | None:
    """``read_records`` from the bytes the log keeps in memory (``SegmentedLog.keep_recent``),
    or None unless it holds them all: then read them in a worker thread.

    No system call, so the event loop serves a PULL of records just stored at once."""
    parts: list[bytes] = []
    read = log.read_recent
    for offset, length, redeliveries in _spans(picked):
        data = read(offset, length)
        if data is None:
            return None
        parts.append(raise_attempts(data, redeliveries) if redeliveries else data)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _spans(picked: list[Picked]) -> Iterator[tuple[int, int, int]]:
    """``(offset, length, redeliveries)`` to read: adjacent first deliveries as one span."""
    index = 0
    count = len(picked)
    while index < count:
        _sequence, redeliveries, offset, size = picked[index]
        if redeliveries:
            yield offset, size, redeliveries
            index += 1
            continue
        end = offset + size
        stop = index + 1
        while stop < count and picked[stop].redeliveries == 0 and picked[stop].offset == end:
            end += picked[stop].size
            stop += 1
        yield offset, end - offset, 0
        index = stop


def read_intact(log: SegmentedLog, picked: list[Picked]) -> tuple[list[Picked], bytes, list[Picked]]:
    """``read_records``, leaving out records that do not check (blocking: a worker thread).

    A byte flipped inside an older segment of the message log is not looked for
    at start-up (that would read the whole log); it is found here. Returns the
    entries whose records were read, their bytes, and the entries left out.
    """
    try:
        return picked, read_records(log, picked), []
    except (CorruptLog, BadOffset):
        pass
    kept: list[Picked] = []
    parts: list[bytes] = []
    bad: list[Picked] = []
    for item in picked:
        try:
            parts.append(read_records(log, [item]))
        except (CorruptLog, BadOffset):
            bad.append(item)
            continue
        kept.append(item)
    return kept, b"".join(parts), bad


def _read_span(log: SegmentedLog, offset: int, length: int) -> bytes:
    chunks: list[bytes] = []
    position = offset
    stop = offset + length
    while position < stop:
        data, next_offset = log.read_raw(position, stop - position)
        if not data or next_offset > stop:
            raise CorruptLog(
                f"message log {log.directory}: no whole records in [{position}, {stop}) "
                "where a consume-log entry points"
            )
        chunks.append(data)
        position = next_offset
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


__all__ = [
    "EntriesNotHeld",
    "Pick",
    "Picked",
    "claimed_entries",
    "pick",
    "read_intact",
    "read_recent_records",
    "read_records",
    "read_window",
]
