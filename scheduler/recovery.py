"""Recovery of a schedule folder when it opens: every hour's files brought back to a
consistent state with the lmdb summaries, checkpoint and heads journal.

``recover_hours`` runs when the store opens (``ScheduleStore.open``). It writes the last
commit's heads journal into the tables again first (its slots may not have reached
them), then checks each hour: it keeps the hour's longest valid prefix of entries (the
invariants ``delayindex.EntryChecker`` checks, and records that check), rolls the heads
forward over valid entries a crash left uncommitted, and, should committed entries or a
table be gone, rebuilds the heads from the index and (for lost entries) moves the
checkpoint back so replay files them again with the same numbers.

Its work is proportional to what no commit vouches for, not to the backlog (a two-year
spread is 17,568 hours): an hour whose index, schedule log and heads table have exactly
the sizes its committed summary gives holds nothing after the commit, and what the
commit covers was fsynced before it, so such an hour costs three ``stat`` calls and no
read. Only an hour with bytes past its summary (a step that died before its commit)
or fewer (damage) is opened and checked. The journal's slots are written again but not
synced here: the journal stays in lmdb until the next commit replaces it, and that
commit makes them durable first (they are marked unsynced), as after any step.

The one module that needs both the index format (``delayindex``) and the heads files
(``headstable``); neither of them imports it.
"""

from __future__ import annotations

import logging
import os
import zlib
from array import array
from dataclasses import dataclass, field
from pathlib import Path

from delaymq.scheduler.delayindex import (
    CHECKPOINT_KEY,
    ENTRY,
    ENTRY_SIZE,
    HOURS_DB,
    JOURNAL_KEY,
    REPLAY_DB,
    EntryChecker,
    Heads,
    HourSummary,
    empty_heads,
    hour_key,
    pack_journal,
    pread_all,
    read_entry,
    record_problem,
    table_slots,
    unpack_journal,
)
from delaymq.scheduler.headstable import TABLE_BYTES, HeadsTables
from delaymq.scheduler.hours import (
    DISPATCH_SUFFIX,
    HEADS_SUFFIX,
    HOUR_MS,
    INDEX_SUFFIX,
    LOG_SUFFIX,
    SECOND_MS,
    hour_name,
    parse_hour_name,
)
from delaymq.scheduler.idindex import (
    DISPLACED_DB,
    IDS_DB,
    KEYS_DB,
    SCHEDULED,
    IdEntry,
    displaced_key,
    filed_subject,
    record_key,
    record_subject,
)
from delaymq.storage.folder import DataFolder
from delaymq.storage.state import StateStore, WriteBatch

_CHECK_WINDOW = 8 << 20  # recovery reads the schedule log this much at a time
#: An entry kept past the commit: ``(source, hour, entry, (index key, key hash, key), ms_in_hour, subject)``.
Rolled = tuple[int, int, int, tuple[str, bytes | None, str | None], int, bytes]

_logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RecoveredHours:
    """What ``recover_hours`` found and did."""

    summaries: dict[int, HourSummary]
    checkpoint: int  # lowered if an hour lost committed entries
    repaired: int  # hours whose files were cut, rolled forward or rebuilt
    checked: int  # hours whose files were opened and checked (the others: vouched by their summary)
    redone_slots: int  # heads slots of the last journal that a table did not hold yet
    dispatch_hours: set[int]  # hours that have a dispatch log


def recover_hours(folder: DataFolder, state: StateStore, names: list[str], tables: HeadsTables) -> RecoveredHours:
    """Bring every hour's files back to a consistent state (``names``: the folder's listing).

    First the last commit's heads journal is written into the tables again (its slots
    may not have reached them), then each hour is checked. The heads changes recovery
    makes are committed as a journal with its lmdb changes and written after, like a
    replay step's.
    """
    files, named = hour_files(names)
    committed = {int.from_bytes(k, "big"): HourSummary.unpack(v) for k, v in state.items(HOURS_DB)}
    stored = state.get(REPLAY_DB, CHECKPOINT_KEY)
    checkpoint = int.from_bytes(stored, "big") if stored is not None else 0
    redone = _redo_journal(state, tables, committed, named)
    found = _HoursFound(restart=checkpoint)
    with state.write() as batch:
        _recover_each_hour(folder, batch, tables, files, named, committed, found)
        _index_rolled(batch, folder.path, found.rolled)
        if found.restart < checkpoint:
            _logger.warning(
                "schedule %s: replay goes back from checkpoint %d to %d to re-file lost entries",
                folder.path,
                checkpoint,
                found.restart,
            )
            batch.put(REPLAY_DB, CHECKPOINT_KEY, found.restart.to_bytes(8, "big"))
            checkpoint = found.restart
        if found.slots:
            # The old journal's slots and the tables created for repairs: durable before it is replaced.
            tables.sync()
            folder.fsync()
            batch.put(REPLAY_DB, JOURNAL_KEY, pack_journal(found.slots))
    if found.slots:
        tables.write(found.slots)
        tables.sync()
    if found.unlinked or found.repaired:
        folder.fsync()
    dispatched = {hour for hour, present in files.items() if DISPATCH_SUFFIX in present}
    return RecoveredHours(found.summaries, checkpoint, found.repaired, found.checked, redone, dispatched)


@dataclass(slots=True)
class _HoursFound:
    """What checking the hours found so far, committed when every hour is done."""

    restart: int  # where replay resumes: the checkpoint, or before entries an hour lost
    summaries: dict[int, HourSummary] = field(default_factory=dict)
    slots: dict[int, int] = field(default_factory=dict)  # heads changes, the new journal
    rolled: list[Rolled] = field(default_factory=list)  # entries kept past the commit
    repaired: int = 0
    checked: int = 0
    unlinked: bool = False  # files removed: the folder is fsynced


def _redo_journal(
    state: StateStore, tables: HeadsTables, committed: dict[int, HourSummary], named: dict[int, str]
) -> int:
    """Write the last commit's heads journal into the tables where a table lacks it; returns
    how many slots that took. Synced by the next commit (or by ``recover_hours``, before a
    repair replaces the journal)."""
    journal = state.get(REPLAY_DB, JOURNAL_KEY)
    if not journal:
        return 0
    redo = unpack_journal(journal)
    redone, _found = tables.redo({key: value for key, value in redo.items() if key >> 12 in committed}, named)
    return redone


def _recover_each_hour(
    folder: DataFolder,
    batch: WriteBatch,
    tables: HeadsTables,
    files: dict[int, set[str]],
    named: dict[int, str],
    committed: dict[int, HourSummary],
    found: _HoursFound,
) -> None:
    """Check every hour that has files or a committed summary, oldest first: an hour its
    summary vouches for is taken as it is, the others are recovered (``_recover_hour``)."""
    prefix = str(folder.path) + os.sep
    summaries = found.summaries
    for hour in sorted(files.keys() | committed.keys()):
        present = files.get(hour, set())
        summary = committed.get(hour)
        if summary is not None and _vouched(prefix + named.get(hour, ""), present, summary):
            summaries[hour] = summary
            continue
        found.checked += 1
        outcome = _recover_hour(folder, batch, tables, found.slots, hour, present, summary, found.rolled)
        summary, hour_restart, changed, removed = outcome
        if summary is not None:
            summaries[hour] = summary
        if hour_restart is not None:
            found.restart = min(found.restart, hour_restart)
        found.repaired += changed
        found.unlinked |= removed


def _recover_hour(
    folder: DataFolder,
    batch: WriteBatch,
    tables: HeadsTables,
    slots: dict[int, int],
    hour: int,
    present: set[str],
    summary: HourSummary | None,
    rolled_out: list[Rolled],
) -> tuple[HourSummary | None, int | None, bool, bool]:
    """One hour: ``(summary or None, replay restart or None, repaired?, files removed?)``.
    The heads changes it needs go into ``slots``, the entries it keeps past the commit into
    ``rolled_out`` (indexed once every hour is recovered)."""
    base = folder.path / hour_name(hour)
    committed = summary.entries if summary is not None else 0
    if INDEX_SUFFIX not in present and committed == 0:
        return None, None, False, _remove_unindexed(tables, hour, base, present)
    rolled: list[Rolled] = []
    checked = _check_hour_files(folder, tables, hour, base, summary, rolled)
    checker, kept = checked.checker, checked.checker.entries
    restart: int | None = None
    if kept < committed:
        # Committed entries are gone (the files were damaged): rebuild the heads and
        # replay again from just after the last entry kept.
        assert summary is not None
        restart = checker.next_source if kept else summary.first_source
    if kept == 0:
        if summary is not None:
            batch.delete(HOURS_DB, hour_key(hour))
        for suffix in (INDEX_SUFFIX, LOG_SUFFIX):
            Path(str(base) + suffix).unlink(missing_ok=True)
        tables.remove(hour)
        return None, restart, checked.changed or kept != committed, True
    if kept < committed or checked.table_lost or committed == 0:
        tables.create(hour)  # a whole table, every slot written by the journal
        slots.update(table_slots(hour, checker.newest, checker.counts))
    elif kept > committed:
        base_key = hour << 12
        for second in checked.touched:
            slots[base_key | second] = (checker.newest[second] + 1) << 32 | checker.counts[second]
    rolled_out.extend(rolled)
    result = HourSummary(kept, checker.log_end, checker.first_source, checker.last_source)
    if kept != committed:
        batch.put(HOURS_DB, hour_key(hour), result.pack())
    return result, restart, checked.changed or kept != committed or checked.table_lost, False


def _remove_unindexed(tables: HeadsTables, hour: int, base: Path, present: set[str]) -> bool:
    """Remove the files of an hour without an index nor committed entries; whether any was there."""
    removed = False
    if LOG_SUFFIX in present:  # a log without an index holds nothing filed
        Path(str(base) + LOG_SUFFIX).unlink()
        removed = True
    if HEADS_SUFFIX in present:  # a table without an index counts nothing
        tables.remove(hour)
        removed = True
    return removed


@dataclass(frozen=True, slots=True)
class _CheckedHour:
    """An hour's files once checked and cut back to their valid prefix."""

    checker: EntryChecker  # what it accepted: the entries kept, their heads
    touched: set[int]  # the seconds the entries it checked fall in
    changed: bool  # the files were cut back
    table_lost: bool  # the heads table was missing or did not count the committed entries


def _check_hour_files(
    folder: DataFolder,
    tables: HeadsTables,
    hour: int,
    base: Path,
    summary: HourSummary | None,
    rolled: list[Rolled],
) -> _CheckedHour:
    """Check an hour's index and schedule log and cut them back to their longest valid prefix.
    Entries its committed end vouches for are not read again; the others are checked, and
    those past the commit go to ``rolled``."""
    name = hour_name(hour)
    committed = summary.entries if summary is not None else 0
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
    index_fd = os.open(str(base) + INDEX_SUFFIX, flags, 0o644)
    log_fd = -1
    try:
        log_fd = os.open(str(base) + LOG_SUFFIX, flags, 0o644)
        index_size = os.fstat(index_fd).st_size
        log_size = os.fstat(log_fd).st_size
        stop = index_size // ENTRY_SIZE
        heads, table_lost = _committed_heads(folder, tables, hour, committed, stop)
        trusted = (
            not table_lost and summary is not None and _committed_end_checks(index_fd, log_fd, stop, log_size, summary)
        )
        start, checker = _start_checker(index_fd, name, summary, heads, trusted)
        touched = _check_entries(checker, index_fd, log_fd, start, stop, log_size, name, rolled, committed, hour)
        changed = index_size != checker.entries * ENTRY_SIZE or log_size != checker.log_end
        if changed:
            _cut_back(folder, name, index_fd, log_fd, checker, stop, committed)
    finally:
        os.close(index_fd)
        if log_fd >= 0:
            os.close(log_fd)
    return _CheckedHour(checker, touched, changed, table_lost)


def _committed_heads(
    folder: DataFolder, tables: HeadsTables, hour: int, committed: int, stop: int
) -> tuple[Heads | None, bool]:
    """``(heads, table lost?)``: the hour's heads table as its last commit left it when there are
    entries past the commit to roll forward over (None otherwise), and whether the table is
    missing or does not count the committed entries (then it is rebuilt from the index)."""
    heads: Heads | None = None
    if committed and stop > committed:  # entries to roll forward over: from the committed heads
        heads = tables.read(hour)
        if heads is not None and heads.entries != committed:
            heads = None
        table_lost = heads is None
    else:
        table_lost = committed > 0 and not tables.exists(hour)
    if table_lost:
        _logger.warning(
            "schedule %s: hour %s: its heads table is missing or does not count its %d entries; "
            "rebuilding it from the index",
            folder.path,
            hour_name(hour),
            committed,
        )
    return heads, table_lost


def _start_checker(
    index_fd: int, name: str, summary: HourSummary | None, heads: Heads | None, trusted: bool
) -> tuple[int, EntryChecker]:
    """``(first entry to check, checker)``: past the committed entries, from their heads, when
    the commit's end is ``trusted`` (or there is none); otherwise from entry 0 and empty heads."""
    committed = summary.entries if summary is not None else 0
    if not (trusted or committed == 0):
        newest, counts = empty_heads()
        return 0, EntryChecker(newest, counts)
    assert summary is not None or committed == 0
    if heads is not None:
        newest, counts = array("i", heads.newest), array("I", heads.counts)
    else:
        newest, counts = empty_heads()
    s = summary or HourSummary(0, 0, -1, -1)
    last_size = 0
    if committed:
        raw = pread_all(index_fd, ENTRY_SIZE, (committed - 1) * ENTRY_SIZE)
        last_size = read_entry(raw, 0, committed - 1, name).size
    checker = EntryChecker(
        newest,
        counts,
        entries=committed,
        log_end=s.log_end,
        first_source=s.first_source,
        last_source=s.last_source,
        next_source=s.last_source + last_size if committed else 0,
    )
    return committed, checker


def _cut_back(
    folder: DataFolder, name: str, index_fd: int, log_fd: int, checker: EntryChecker, stop: int, committed: int
) -> None:
    """Cut an hour's index and schedule log to the entries ``checker`` kept, durably."""
    kept = checker.entries
    _logger.warning(
        "schedule %s: hour %s: kept %d entries of %d (%d committed): %s",
        folder.path,
        name,
        kept,
        stop,
        committed,
        checker.problem or "torn tail",
    )
    os.ftruncate(index_fd, kept * ENTRY_SIZE)
    os.ftruncate(log_fd, checker.log_end)
    os.fsync(index_fd)
    os.fsync(log_fd)


def hour_files(names: list[str]) -> tuple[dict[int, set[str]], dict[int, str]]:
    """The schedule files among a folder's ``names``, by hour (``{hour: {".log", ".index", ...}}``),
    and each hour's name (each name parsed once, not once per file)."""
    suffixes = (LOG_SUFFIX, INDEX_SUFFIX, DISPATCH_SUFFIX, HEADS_SUFFIX)
    stems: dict[str, int | None] = {}
    files: dict[int, set[str]] = {}
    named: dict[int, str] = {}
    for name in names:
        stem, dot, suffix = name.partition(".")
        suffix = "." + suffix
        if not dot or suffix not in suffixes:
            continue
        hour = stems.get(stem, -1)
        if hour == -1:
            try:
                hour = stems[stem] = parse_hour_name(stem)
            except ValueError:
                hour = stems[stem] = None
            if hour is not None:
                named[hour] = stem
        if hour is not None:
            files.setdefault(hour, set()).add(suffix)
    return files, named


def _vouched(base: str, present: set[str], summary: HourSummary) -> bool:
    """Whether an hour's files hold exactly what its committed summary says (three ``stat``s):
    nothing a crash left after the commit, nothing lost, a whole heads table."""
    if summary.entries == 0 or not {INDEX_SUFFIX, LOG_SUFFIX, HEADS_SUFFIX} <= present:
        return False
    try:
        return (
            os.stat(base + INDEX_SUFFIX).st_size == summary.entries * ENTRY_SIZE
            and os.stat(base + LOG_SUFFIX).st_size == summary.log_end
            and os.stat(base + HEADS_SUFFIX).st_size == TABLE_BYTES
        )
    except FileNotFoundError:
        return False


def _committed_end_checks(index_fd: int, log_fd: int, stop: int, log_size: int, summary: HourSummary) -> bool:
    """Whether the hour's last committed entry and its record are intact where the summary says."""
    n = summary.entries
    if n == 0:
        return True
    if stop < n or log_size < summary.log_end:
        return False
    buf = pread_all(index_fd, ENTRY_SIZE, (n - 1) * ENTRY_SIZE)
    offset, size, _ms, _prev, source, crc = ENTRY.unpack(buf)
    if zlib.crc32(buf[:28]) != crc or offset + size != summary.log_end or source != summary.last_source:
        return False
    return not record_problem(pread_all(log_fd, size, offset), 0, size)


def _index_rolled(batch: WriteBatch, folder: Path, rolled: list[Rolled]) -> None:
    """Put the entries kept past the commit in the id index (``delaymq.scheduler.idindex``), as
    their step would have, in log order whatever their hours: replay skips their records as
    filed, and the cancels and moves it applies again find them there. An id held by a
    message of another subject moves that one to its displaced key, as filing does."""
    for source, hour, entry_no, (index_key, hashed, _key), ms_in_hour, subject in sorted(rolled):
        key = index_key.encode()
        stored = batch.get(IDS_DB, key)
        if stored is not None:
            held = IdEntry.unpack(stored)
            if held.source >= source:
                continue
            holder = None if "\x00" in index_key else filed_subject(folder, held)
            if holder is not None and holder != subject:
                moved = displaced_key(index_key, holder).encode()
                batch.put(DISPLACED_DB, moved, stored)
                if held.key_hash is not None:
                    batch.put(KEYS_DB, held.key_hash + moved, b"")
        batch.put(IDS_DB, key, IdEntry(hour * HOUR_MS + ms_in_hour, entry_no, source, SCHEDULED, hashed).pack())
        if hashed is not None:
            batch.put(KEYS_DB, hashed + key, b"")


def _check_entries(
    checker: EntryChecker,
    index_fd: int,
    log_fd: int,
    start: int,
    stop: int,
    log_size: int,
    name: str,
    rolled: list[Rolled] | None = None,
    committed: int = 0,
    hour: int = 0,
) -> set[int]:
    """Feed entries ``start .. stop - 1`` and their records to ``checker`` until one fails;
    returns the seconds the accepted ones fall in. Each accepted entry from ``committed`` on
    goes to ``rolled`` with its record's index key and subject (``Rolled``)."""
    touched: set[int] = set()
    window = b""
    window_start = 0
    n = start
    while n < stop:
        count = min(stop - n, 1 << 16)
        buf = pread_all(index_fd, count * ENTRY_SIZE, n * ENTRY_SIZE)
        for i in range(count):
            entry = checker.check(buf, i * ENTRY_SIZE, log_size)
            if entry is None:
                return touched
            position = entry.offset - window_start
            if position < 0 or position + entry.size > len(window):
                window_start = entry.offset
                size = min(max(_CHECK_WINDOW, entry.size), log_size - entry.offset)
                window = pread_all(log_fd, size, entry.offset)
                position = 0
            problem = record_problem(window, position, entry.size)
            if problem:
                checker.problem = f"entry {checker.entries}'s record at log byte {entry.offset}: {problem}"
                return touched
            if rolled is not None and checker.entries >= committed:
                keys = record_key(window, position)
                subject = record_subject(window, position)
                rolled.append((entry.source, hour, checker.entries, keys, entry.ms_in_hour, subject))
            checker.take(entry)
            touched.add(entry.ms_in_hour // SECOND_MS)
        n += count
    return touched


__all__ = ["RecoveredHours", "hour_files", "recover_hours"]
