"""The schedule folder as it is on disk: its ``FORMAT`` parameters, the bytes an hour's
committed summary gives its files, opening it (format checked, heads tables opened,
every hour recovered) for ``ScheduleStore.open`` (``delaymq.scheduler.schedulelog``),
and rebuilding an hour's heads table from its delay index (``ScheduleStore.rebuild_heads``).
"""

from __future__ import annotations

import os
from functools import partial

from delaymq.scheduler.delayindex import (
    ENTRY_SIZE,
    INDEX_VERSION,
    JOURNAL_KEY,
    JOURNAL_RECORD,
    REPLAY_DB,
    Heads,
    HourSummary,
    heads_from_index,
    pack_journal,
    table_slots,
)
from delaymq.scheduler.headstable import TABLE_BYTES, HeadsTables
from delaymq.scheduler.hours import (
    DISPATCH_SUFFIX,
    HEADS_SUFFIX,
    INDEX_SUFFIX,
    LOG_SUFFIX,
    CorruptSchedule,
    hour_name,
)
from delaymq.scheduler.idindex import DISPLACED_DB, IDS_DB
from delaymq.scheduler.recovery import RecoveredHours, recover_hours
from delaymq.scheduler.schedulefiles import syncfs
from delaymq.storage.folder import DataFolder
from delaymq.storage.format import FormatParams, ensure_format
from delaymq.storage.state import StateStore

STORE_FORMAT = "schedule-store"
STORE_FORMAT_VERSION = 2  # 2: heads tables in files (version 1 kept them as lmdb keys)

_FORMAT: FormatParams = {
    "format": STORE_FORMAT,
    "version": STORE_FORMAT_VERSION,
    "index_version": INDEX_VERSION,
    "index_entry_size": ENTRY_SIZE,
    "hour_names": "YYYYMMDDHH UTC",
    "heads": f"YYYYMMDDHH{HEADS_SUFFIX} {TABLE_BYTES} bytes, journal in lmdb",
    "heads_journal_record": JOURNAL_RECORD.size,
    "dispatch_entry": "u32 big-endian",
}


def summary_bytes(summary: HourSummary) -> int:
    """The bytes of an hour's schedule log, delay index and heads table as its committed
    summary gives them (what they hold on disk once recovery has run)."""
    return summary.log_end + summary.entries * ENTRY_SIZE + TABLE_BYTES


def open_schedule_folder(folder: DataFolder, state: StateStore, *, fsync: bool) -> tuple[HeadsTables, RecoveredHours]:
    """Check the folder's ``FORMAT``, open its heads tables and recover every hour's files
    (``delaymq.scheduler.recovery``). Blocking; the caller closes ``folder`` if it raises."""
    names = os.listdir(folder.path)
    suffixes = (LOG_SUFFIX, INDEX_SUFFIX, DISPATCH_SUFFIX, HEADS_SUFFIX)
    has_data = any(n.endswith(suffixes) for n in names)
    ensure_format(folder.path, _FORMAT, has_data=has_data)
    sync_fs = None if syncfs is None else partial(syncfs, folder)
    tables = HeadsTables(folder.path, fsync=fsync, syncfs=sync_fs)
    recovered = recover_hours(folder, state, names, tables)
    state.keep_highest_key(IDS_DB)  # for ``past_every_indexed`` and filing
    state.keep_highest_key(DISPLACED_DB)  # for ``idindex.may_be_displaced``
    return tables, recovered


def rebuild_heads_table(
    folder: DataFolder, state: StateStore, tables: HeadsTables, hour: int, summary: HourSummary, *, fsync: bool
) -> Heads:
    """Recompute ``hour``'s heads table from the entries of its delay index ``summary``
    counts, and store it: the table created whole, its slots committed as the heads
    journal and then written, as a replay step's are."""
    path = folder.path / (hour_name(hour) + INDEX_SUFFIX)
    data = path.read_bytes()[: summary.entries * ENTRY_SIZE]
    heads = heads_from_index(hour, data, where=str(path))
    if heads.entries != summary.entries:
        raise CorruptSchedule(f"{path}: holds {heads.entries} entries, its summary says {summary.entries}")
    slots = table_slots(hour, heads.newest, heads.counts)
    tables.create(hour)
    tables.sync()  # the slots the last journal wrote, before it is replaced
    if fsync:
        folder.fsync()
    with state.write() as batch:
        batch.put(REPLAY_DB, JOURNAL_KEY, pack_journal(slots))
    tables.write(slots)
    return heads


__all__ = ["STORE_FORMAT", "STORE_FORMAT_VERSION", "open_schedule_folder", "rebuild_heads_table", "summary_bytes"]
