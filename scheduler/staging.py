"""A replay step's staging: records filed into their hours in memory until the commit.

``ScheduleStore.stage`` hands each chunk read from the message log to
``StagedStep.stage``. Per hour (``StagedHour``) it keeps the record bytes as slices of
the chunks read (runs of adjacent records as one slice), the new index entries packed
into a bytearray, and each entry's ``ms_in_hour``; per second filed into, the heads
slot (newest entry and count), read from the hour's heads table when the step first
touches that second. Nothing touches the disk here but those reads:
``ScheduleStore.commit`` writes the hours' bytes (``schedulefiles``), commits lmdb with
the slots as the heads journal, and clears the step; ``ReplayStep`` says what it did.
Memory is the step's, never the backlog's: nothing of the heads stays between steps.
``StagedHour``, ``ReplayStep`` and ``HourArrivals`` are ``delaymq.scheduler.replaystep``'s,
importable from here too.

A record whose message-log offset is not after its hour's last filed one was filed
before a crash (or before its hour was deleted) and is skipped, so re-reading from the
checkpoint files nothing twice. ``_file_messages`` is the hot loop of replay: its aliases of
bound methods and attributes are deliberate.

An id takes its index key from the message that held it; if that one is of another
subject it moves to its displaced key (``delaymq.scheduler.idindex``). The hot loop only
notes the ids that were held (set earlier in the step, or possibly in lmdb: not above its
highest key, which new time-ordered ids are), and ``_settle_holders`` decides them in log
order before the next CANCEL or MOVE record is applied.
"""

from __future__ import annotations

import os
import zlib
from array import array
from collections.abc import Iterator

from delaymq.protocol.envelope import HEADER_SIZE, RecordKind
from delaymq.protocol.records import RECORD_TIMES
from delaymq.scheduler.delayindex import (
    DELETED_DB,
    ENTRY_BODY,
    ENTRY_CRC,
    MAX_ENTRIES,
    HourSummary,
    hour_key,
)
from delaymq.scheduler.headstable import HeadsTables
from delaymq.scheduler.hours import (
    HOUR_MS,
    MAX_DELIVER_AT,
    CorruptSchedule,
    HourOutOfRange,
    ScheduleError,
    hour_name,
)
from delaymq.scheduler.idindex import ID_VALUE, IDS_DB, SCHEDULED, IdChanges, IdEntry, filed_subjects
from delaymq.scheduler.indexrecords import (
    CANCEL_KIND,
    ID_AT,
    KEY_FIELDS,
    KEY_FIELDS_AT,
    LATE_KIND,
    LATE_RECORDS_AT,
    MOVE_KIND,
    cancel_keys,
    displaced_key,
    move_spans,
    record_index_key,
    record_key,
    record_subject,
)
from delaymq.scheduler.replaystep import HourArrivals, ReplayStep, StagedHour
from delaymq.storage.state import StateStore

_MESSAGE = int(RecordKind.MESSAGE)
_pack_body = ENTRY_BODY.pack
_pack_crc = ENTRY_CRC.pack
_crc32 = zlib.crc32
#: Sorts above every UTF-8 key: when the index's highest key is not known, every id may be held.
_ABOVE_ALL = b"\xff"
#: An id the hot loop found held: ``(index key, the value it had or None: ask lmdb, record position)``.
Held = tuple[bytes, bytes | None, int]


class StagedStep:
    """The replay step being filed: each hour's ``StagedHour`` and the heads slots of
    the seconds it files into. One per store, cleared after each commit or abort; used
    by the thread holding the store's write lock.

    ``summaries`` (committed, per hour) and ``checked_hours`` (hours whose table was
    checked against their summary since open) are the store's own: the step reads
    them, and adds to ``checked_hours`` the hours whose whole table it checked.
    """

    def __init__(
        self,
        summaries: dict[int, HourSummary],
        checked_hours: set[int],
        tables: HeadsTables,
        state: StateStore,
        *,
        max_step_hours: int,
        folder: str | os.PathLike[str] | None = None,
    ) -> None:
        self._summaries = summaries
        self._folder = folder  # the schedule folder: an indexed message's record is read there
        self._checked_hours = checked_hours
        self._tables = tables
        self._state = state  # read for the tombstones of deleted hours
        self._max_step_hours = max_step_hours
        # The heads slots the current step files into: key hour << 12 | second, value
        # (newest + 1) << 32 | count (0: no entry). Read from the tables when the step
        # first touches a second, committed as the step's journal, dropped after it or
        # on abort: nothing of the heads stays in memory between steps.
        self._heads: dict[int, int] = {}
        self._heads_max = 0
        #: The heads tables the step read a slot from, open until it ends (hour -> fd).
        self._open_tables: dict[int, int] = {}
        self._staged: dict[int, StagedHour] = {}
        self._step_filed = self._step_already = self._step_skipped = 0
        #: The step's changes to the id and key index (``delaymq.scheduler.idindex``), and
        #: the entries its CANCEL and MOVE records cancel, committed with it.
        self.changes = IdChanges(state)

    @property
    def hours(self) -> dict[int, StagedHour]:
        """The hours the step has filed into (read only)."""
        return self._staged

    @property
    def heads(self) -> dict[int, int]:
        """The step's heads slots: after its commit, its journal (read only)."""
        return self._heads

    @property
    def heads_max(self) -> int:
        """The most heads slots one step held since open."""
        return self._heads_max

    def outcome(self, written: list[StagedHour], start_offset: int, checkpoint: int) -> ReplayStep:
        """What the step did, once committed (``written``: its hours with new entries)."""
        arrivals: dict[int, HourArrivals] = {}
        new_hours = []
        for w in written:
            if w.committed_entries == 0:
                new_hours.append(w.hour)
            arrivals[w.hour] = HourArrivals(w.hour, w.committed_entries, w.ms)
        return ReplayStep(
            start_offset=start_offset,
            checkpoint=checkpoint,
            filed=self._step_filed,
            already_filed=self._step_already,
            skipped=self._step_skipped,
            bytes=max(0, checkpoint - start_offset),
            arrivals=arrivals,
            new_hours=tuple(sorted(new_hours)),
            cancelled=self.changes.cancelled,
        )

    def stage(self, buf: bytes, source: int, stop: int) -> int:
        """Stage the records of ``buf[:stop]`` (whole records, read from the message log at
        offset ``source``); returns how many bytes were consumed (see ``ScheduleStore.stage``).
        Raises on a record it cannot file, leaving what it staged before it: the caller
        aborts the step."""
        view = memoryview(buf)
        unpack = RECORD_TIMES.unpack_from
        pos = 0
        while pos < stop:
            pos = self._file_messages(buf, view, pos, stop, source)
            if pos >= stop:
                break
            # ``_file_messages`` stopped at a whole record (it refuses one past ``stop``).
            size, _magic, _version, kind, _crc, at, _created = unpack(buf, pos)
            if kind == _MESSAGE:
                break  # the step touched max_step_hours hours
            end = pos + HEADER_SIZE + size
            if kind == CANCEL_KIND or kind == MOVE_KIND:
                if not self._stage_change(buf, view, pos, end, source, kind):
                    break  # the step touched max_step_hours hours
            elif kind == LATE_KIND:
                if not self._stage_late(buf, view, pos, end, source, at):
                    break  # the step touched max_step_hours hours
            else:
                self._step_skipped += 1
            pos = end
        if len(self._heads) > self._heads_max:
            self._heads_max = len(self._heads)
        return pos

    def _file_messages(self, buf: bytes, view: memoryview, pos: int, stop: int, source: int, floor: int = 0) -> int:
        """File the message records from ``buf[pos:]`` on (message-log offset ``source + pos``),
        until ``stop``, a record of another kind, or one that would take the step past
        ``max_step_hours`` hours; returns where it stopped. Each is filed at its ``deliver_at``,
        or at ``floor`` if that is later (a LATE record's, ``_stage_late``).

        The one place an entry is made (messages and moved records alike), and the hot loop
        of replay: the hour being filed into lives in local names (entry count, log end, the
        run of adjacent records, ...) and goes back to its ``StagedHour`` when the next record
        is of another hour or the loop ends, so a step whose records fall in few hours pays
        for no attribute per record."""
        unpack = RECORD_TIMES.unpack_from
        unpack_key_fields = KEY_FIELDS.unpack_from
        # A plain message (no retry, no properties): its index key is its id's bytes, its
        # value packed here without a key hash; anything else asks idindex for key and hash.
        plain = type(buf) is bytes
        pack_value = ID_VALUE.pack
        pack_body, pack_crc, crc32 = _pack_body, _pack_crc, _crc32
        values = self.changes.values
        setdefault = values.setdefault
        key_entry = self.changes.key_entries.append
        highest = self._highest_indexed()  # an id above it is in no lmdb value
        held: list[Held] = []  # ids found held, in log order (``_settle_holders``)
        note_held = held.append
        staged = self._staged
        heads = self._heads
        heads_get = heads.get
        stored_head = self._stored_head
        limit = self._max_step_hours
        filed = already = 0
        # The hour in local names (``w`` None: none yet; no time falls in the hour of ``base_ms``).
        w: StagedHour | None = None
        hour = n = log_end = key_base = last_source = run_start = run_end = -1
        base_ms = -HOUR_MS - 1
        index = bytearray()
        ms_append = array("I").append
        run_view: memoryview | None = None
        first = False  # the hour's first entry ever is still to come
        # One loop, no call per record: records spread over many hours switch hour at almost
        # every record, and a call there or per record would cost measurably on replay.
        try:
            while pos < stop:
                size, _magic, _version, kind, _crc, at, created = unpack(buf, pos)
                end = pos + HEADER_SIZE + size
                if end > stop:
                    raise _cut_by_stop(source, pos, end, stop)
                if kind != _MESSAGE:
                    break
                if at <= floor:  # a LATE record's (filed at ``floor``), or "now" (0: at created_at)
                    at = floor if floor > 0 else created if created > 0 else 0
                if not base_ms <= at < base_ms + HOUR_MS:
                    if w is not None:
                        w.entries, w.log_end, w.last_source = n, log_end, last_source
                        w.run_view, w.run_start, w.run_end = run_view, run_start, run_end
                    hour = at // HOUR_MS
                    w = staged.get(hour)
                    if w is None:
                        if len(staged) >= limit:
                            w = None  # parked already
                            break
                        w = self._stage_hour(hour, at, source + pos)
                    n, log_end, last_source = w.entries, w.log_end, w.last_source
                    run_view, run_start, run_end = w.run_view, w.run_start, w.run_end
                    base_ms, key_base, index, ms_append = w.base_ms, w.key_base, w.index, w.ms.append
                    first = w.first_source < 0
                src = source + pos
                if src <= last_source:
                    already += 1
                    pos = end
                    continue
                if n >= MAX_ENTRIES:
                    raise _hour_full(hour)
                ms = at - base_ms
                key = key_base | ms // 1000
                head = heads_get(key, -1)
                if head < 0:
                    head = stored_head(key)  # the step's first entry of this second
                heads[key] = (n + 1) << 32 | ((head & 0xFFFF_FFFF) + 1)
                length = end - pos
                body = pack_body(log_end, length, ms, (head >> 32) - 1, src)
                index += body
                index += pack_crc(crc32(body))
                log_end += length
                if run_end == pos and run_view is view:
                    run_end = end
                else:
                    if run_view is not None:
                        w.parts.append(run_view[run_start:run_end])  # type: ignore[union-attr]
                    run_view, run_start, run_end = view, pos, end
                ms_append(ms)
                last_source = src
                if first:
                    w.first_source = src  # type: ignore[union-attr]
                    first = False
                attempts, id_len, props_len = unpack_key_fields(buf, pos + KEY_FIELDS_AT)
                if plain and not attempts and not props_len:
                    p = pos + ID_AT
                    k = buf[p : p + id_len]
                    v = pack_value(at, n, src, SCHEDULED)
                else:
                    k, hashed = record_index_key(buf, pos)
                    v = pack_value(at, n, src, SCHEDULED)
                    if hashed is not None:
                        v += hashed
                        key_entry(hashed + k)
                    if b"\x00" in k:  # a retry's key names its subject: never another subject's
                        values[k] = v
                        k = b""
                if k:
                    old = setdefault(k, v)
                    if old is not v:  # set earlier in the step
                        values[k] = v
                        note_held((k, old, pos))
                    elif k <= highest:  # lmdb may hold it
                        note_held((k, None, pos))
                n += 1
                filed += 1
                pos = end
        finally:
            if w is not None:
                w.entries, w.log_end, w.last_source = n, log_end, last_source
                w.run_view, w.run_start, w.run_end = run_view, run_start, run_end
            self._step_filed += filed
            self._step_already += already
        if held:
            self._settle_holders(held, buf)
        return pos

    def _highest_indexed(self) -> bytes:
        try:
            return self._state.highest_key(IDS_DB)
        except KeyError:  # not kept in memory: look every id up
            return _ABOVE_ALL

    def _settle_holders(self, held: list[Held], buf: bytes) -> None:
        """For each id the hot loop found held (in log order): if the message that held it is
        of another subject than the record at the noted position, it moves to its displaced
        key. The values of ids lmdb may hold are read in one transaction."""
        changes = self.changes
        ask = [k for k, old, _pos in held if old is None]
        stored = dict(zip(ask, changes.stored(ask))) if ask else {}
        values = [stored.get(k) if old is None else old for k, old, _pos in held]
        holders = self._subjects_of([IdEntry.unpack(value) for value in values if value is not None])
        for (k, _old, pos), value in zip(held, values):
            if value is None:
                continue
            holder = next(holders)
            if holder is not None and holder != record_subject(buf, pos):
                changes.displace(k, value, holder)

    def _subjects_of(self, values: list[IdEntry]) -> Iterator[bytes | None]:
        """The subject of the message each value points to: staged in this step, or filed (None:
        its record cannot be read; the id is then taken as before, without a move)."""
        staged: dict[int, bytes] = {}
        filed: list[int] = []
        for i, value in enumerate(values):
            w = self._staged.get(value.hour)
            if w is not None and value.entry >= w.committed_entries:
                staged[i] = record_subject(w.record(value.entry), 0)
            else:
                filed.append(i)
        if filed and self._folder is not None:
            read = filed_subjects(self._folder, [values[i] for i in filed])
        else:
            read = [None] * len(filed)
        found = dict(zip(filed, read))
        return (staged[i] if i in staged else found[i] for i in range(len(values)))

    def _subject_of(self, value: IdEntry) -> bytes | None:
        return next(self._subjects_of([value]))

    def _stage_change(self, buf: bytes, view: memoryview, pos: int, end: int, source: int, kind: int) -> bool:
        """Apply a CANCEL or MOVE record (at ``view[pos:end]``, message-log offset ``source + pos``).
        False, with nothing done, if its moved records would take the step past ``max_step_hours``."""
        src = source + pos
        if kind == CANCEL_KIND:
            keys = cancel_keys(view[pos + HEADER_SIZE : end])
            read = self.changes.read(keys)
            for index_key in keys:
                self.changes.cancel(index_key, src, read=read)
            return True
        spans = move_spans(view, pos, end)
        new_hours = {_filed_at(view, start) // HOUR_MS for start, _end in spans} - self._staged.keys()
        if new_hours and len(self._staged) + len(new_hours) > self._max_step_hours:
            return False
        for start, inner_end in spans:
            index_key, _hashed, _key = record_key(view, start)
            moved = self._moved_key(index_key, view, start)
            # Its new entry takes ``index_key`` again: only a displaced key keeps the cancelled value.
            self.changes.cancel(moved, src, moving=moved == index_key)
            if self._file_messages(buf, view, start, inner_end, source) != inner_end:
                raise ScheduleError(f"MOVE record at message-log offset {src}: a moved record was not filed")
        return True

    def _stage_late(self, buf: bytes, view: memoryview, pos: int, end: int, source: int, filed_at: int) -> bool:
        """File the records of a LATE record (at ``view[pos:end]``) at ``filed_at``, each keeping
        its own ``deliver_at``. False, with nothing done, if that would take the step past
        ``max_step_hours`` hours: a step never stops inside it, so the checkpoint stays at a
        record of the log (the records inside parse as records too, but would file at their
        own, earlier, moments)."""
        if filed_at // HOUR_MS not in self._staged and len(self._staged) >= self._max_step_hours:
            return False
        if self._file_messages(buf, view, pos + LATE_RECORDS_AT, end, source, filed_at) != end:
            raise ScheduleError(
                f"LATE record at message-log offset {source + pos}: a record in it was not filed at {filed_at}"
            )
        return True

    def _moved_key(self, index_key: str, view: memoryview, start: int) -> str:
        """Where the message a MOVE record re-files is indexed now: under its id if the id's
        holder is of its subject, otherwise displaced (the master moved what it found there)."""
        if "\x00" in index_key:
            return index_key
        subject = record_subject(view, start)
        holder = self.changes.current(index_key)
        if holder is not None and self._subject_of(holder) in (subject, None):
            return index_key
        return displaced_key(index_key, subject)

    def _stage_hour(self, hour: int, at: int, src: int) -> StagedHour:
        if not 0 <= hour <= (MAX_DELIVER_AT // HOUR_MS):
            raise HourOutOfRange(
                f"record at message-log offset {src}: deliver_at {at} is beyond {MAX_DELIVER_AT} "
                "(MAX_DELIVER_AT, 9999-12-31 UTC), the last hour a schedule log can be named for"
            )
        summary = self._summaries.get(hour)
        if summary is None:
            # A deleted hour filed again: the records it held before must not come back
            # (replay can go back past them after a repair), so start after them.
            tombstone = self._state.get(DELETED_DB, hour_key(hour))
            last = -1 if tombstone is None else int.from_bytes(tombstone, "big", signed=True)
            summary = HourSummary(0, 0, -1, last)
        w = self._staged[hour] = StagedHour(hour, summary)
        return w

    def _stored_head(self, key: int) -> int:
        """The stored heads slot ``key`` (``hour << 12 | second``): ``(newest + 1) << 32 | count``,
        0 if empty. Read when the step first files into that second (each later record of it
        finds the step's own value), from a file the step keeps open until it ends. The first
        read of an hour since open reads its whole table and checks it counts the hour's
        entries (lost or stale heads would link new entries wrongly)."""
        hour = key >> 12
        summary = self._summaries.get(hour)
        if summary is None or not summary.entries:
            return 0  # a new hour: every slot is empty
        second = key & 0xFFF
        if hour in self._checked_hours:
            return self._tables.read_slot(hour, second, self._open_tables)
        table = self._tables.read(hour)
        if table is None or table.entries != summary.entries:
            found = "no whole table" if table is None else f"a table counting {table.entries}"
            raise CorruptSchedule(
                f"hour {hour_name(hour)}: holds {summary.entries} entries but its heads have {found}; "
                f"run rebuild_heads({hour})"
            )
        self._checked_hours.add(hour)
        count = table.counts[second]
        return (table.newest[second] + 1) << 32 | count if count else 0

    def clear(self) -> None:
        self._tables.close_all(self._open_tables)
        self._staged = {}
        self._heads = {}
        self.changes.clear()
        self._step_filed = self._step_already = self._step_skipped = 0


def _cut_by_stop(source: int, pos: int, end: int, stop: int) -> ScheduleError:
    return ScheduleError(
        f"record at message-log offset {source + pos} ends at {source + end}, "
        f"past the end of what was given to stage ({source + stop})"
    )


def _hour_full(hour: int) -> ScheduleError:
    return ScheduleError(f"hour {hour_name(hour)}: an hour holds at most {MAX_ENTRIES} entries (MAX_ENTRIES)")


def _filed_at(buf: bytes | memoryview, pos: int) -> int:
    """When the message record at ``buf[pos:]`` is filed: its ``deliver_at``, or for 0 or below
    (immediate) its ``created_at`` (0 if that is not above 0), as ``_file_messages`` files it."""
    fields = RECORD_TIMES.unpack_from(buf, pos)
    at, created = int(fields[5]), int(fields[6])
    if at <= 0:
        at = created if created > 0 else 0
    return at


__all__ = ["HourArrivals", "ReplayStep", "StagedHour", "StagedStep"]
