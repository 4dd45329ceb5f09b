"""The id index cut back to a message-log offset: what filing the log up to it gives.

A slave (or a deposed master rejoining) cuts the tail of its message log that its master
never had (``delaymq.scheduler.cutback`` cuts the schedule folder); ``drop_from`` undoes
what those records did to the id index (``delaymq.scheduler.idindex``). Blocking.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

from delaymq.scheduler.delayindex import ENTRY_SIZE, read_entry
from delaymq.scheduler.hours import HOUR_MS, INDEX_SUFFIX, LOG_SUFFIX, CorruptSchedule, hour_name
from delaymq.scheduler.idindex import (
    CANCELLED,
    CANCELLED_DB,
    DISPLACED_DB,
    DISPLACED_SEPARATOR,
    ID_AT,
    IDS_DB,
    KEY_HASH_SIZE,
    KEYS_DB,
    SCHEDULED,
    IdEntry,
    cancelled_by,
    cancelled_key,
    cancelled_place,
    displaced_key,
    record_key,
    record_subject,
)
from delaymq.storage.state import StateStore


class _Filed(NamedTuple):
    """A filed entry as a cut-back reads it back from its hour's files (sorts in filing order)."""

    source: int  # message-log offset of the record it was filed from
    hour: int
    entry: int
    deliver_at: int
    index_key: bytes
    subject: bytes
    key_hash: bytes | None


def drop_from(state: StateStore, offset: int, folder: str | os.PathLike[str]) -> int:
    """Undo what the records from message-log ``offset`` on did to the index (a cut-back of
    entries the master never had; ``folder``: the schedule folder, cut already or not), so
    it holds what filing the log up to ``offset`` gives. Returns how many values changed.

    A CANCEL or MOVE rewrites its values' ``source``: a value's ``source`` does not say when
    its message was filed, its delay index entry does. Each id such a record touched (a
    value of it set at or after ``offset``: every later value of its keys is too) is filed
    again, in log order, from the entries before ``offset`` that the index and
    ``scheduler.cancelled`` still name; the cut records' cancelled rows go. Exact but for a
    delivered message whose value a cut record replaced (nothing names it any more).
    Blocking; reads the whole index."""
    touched = _touched_ids(state, offset)
    rows = {key: cancelled_by(value) for key, value in state.items(CANCELLED_DB)}
    current: dict[tuple[str, bytes], bytes] = {}
    for message_id in touched:
        current.update(_values_of_id(state, message_id))
    rebuilt, key_entries = _rebuilt(folder, offset, touched, current, rows)
    stale = {entry for entry, _ in state.items(KEYS_DB) if entry[KEY_HASH_SIZE:].partition(b"\x00")[0] in touched}
    with state.write() as batch:
        for key, source in rows.items():
            if source >= offset:  # cancels the master never had: their entries fire after all
                batch.delete(CANCELLED_DB, key)
        for db_key in current.keys() - rebuilt.keys():
            batch.delete(*db_key)
        for (db, key), value in rebuilt.items():
            if current.get((db, key)) != value:
                batch.put(db, key, value)
        for entry in stale - key_entries:
            batch.delete(KEYS_DB, entry)
        for entry in key_entries - stale:
            batch.put(KEYS_DB, entry, b"")
    return sum(current.get(db_key) != rebuilt.get(db_key) for db_key in current.keys() | rebuilt.keys())


def _rebuilt(
    folder: str | os.PathLike[str],
    offset: int,
    touched: set[bytes],
    current: dict[tuple[str, bytes], bytes],
    rows: dict[bytes, int],
) -> tuple[dict[tuple[str, bytes], bytes], set[bytes]]:
    """The values and key entries of the ``touched`` ids as filing the log up to ``offset``
    leaves them, from the entries filed before it that their ``current`` values and the
    cancelled ``rows`` name (a message a cut record cancelled, or replaced under its id
    after a cancel or move, is named by its row only)."""
    if not touched:
        return {}, set()
    places = {(value.hour, value.entry) for value in map(IdEntry.unpack, current.values())}
    places.update(cancelled_place(key) for key in rows)
    by_id: dict[bytes, list[_Filed]] = {}
    for filed in _read_filed(folder, places, offset):
        message_id = filed.index_key.partition(b"\x00")[0]
        if message_id in touched:
            by_id.setdefault(message_id, []).append(filed)
    kept_rows = {key: source for key, source in rows.items() if source < offset}
    rebuilt: dict[tuple[str, bytes], bytes] = {}
    key_entries: set[bytes] = set()
    for message_id, entries in by_id.items():
        values, hashed = _refiled(message_id, entries, kept_rows)
        rebuilt.update(values)
        key_entries |= hashed
    return rebuilt, key_entries


def _touched_ids(state: StateStore, offset: int) -> set[bytes]:
    """The ids of the values set (filed, displaced, cancelled) by a record at or after ``offset``."""
    return {
        key.partition(b"\x00")[0]
        for db in (IDS_DB, DISPLACED_DB)
        for key, value in state.items(db)
        if IdEntry.unpack(value).source >= offset
    }


def _values_of_id(state: StateStore, message_id: bytes) -> dict[tuple[str, bytes], bytes]:
    """Every value of ``message_id``'s keys (its id, its retries' keys, its displaced keys)."""
    found = {(IDS_DB, key): value for key, value in state.items(IDS_DB, message_id + b"\x00")}
    found.update(
        ((DISPLACED_DB, key), value) for key, value in state.items(DISPLACED_DB, message_id + DISPLACED_SEPARATOR)
    )
    value = state.get(IDS_DB, message_id)
    if value is not None:
        found[(IDS_DB, message_id)] = value
    return found


def _read_filed(folder: str | os.PathLike[str], places: Iterable[tuple[int, int]], before: int) -> list[_Filed]:
    """The entries at ``places`` (hour, entry) filed from a record before message-log offset
    ``before``, each hour's two files opened once (an entry cut, or not readable, is left out)."""
    by_hour: dict[int, list[int]] = {}
    for hour, entry in places:
        by_hour.setdefault(hour, []).append(entry)
    found: list[_Filed] = []
    for hour, entries in by_hour.items():
        base = Path(folder) / hour_name(hour)
        try:
            with open(str(base) + INDEX_SUFFIX, "rb") as index, open(str(base) + LOG_SUFFIX, "rb") as log_file:
                for entry in entries:
                    filed = _read_one(index.fileno(), log_file.fileno(), hour, entry)
                    if filed is not None and filed.source < before:
                        found.append(filed)
        except OSError:
            continue
    return found


def _read_one(index_fd: int, log_fd: int, hour: int, entry: int) -> _Filed | None:
    raw = os.pread(index_fd, ENTRY_SIZE, ENTRY_SIZE * entry)
    if len(raw) < ENTRY_SIZE:
        return None
    try:
        head = read_entry(raw, 0, entry, hour_name(hour))
    except CorruptSchedule:
        return None
    record = os.pread(log_fd, head.size, head.offset)
    if len(record) != head.size or head.size <= ID_AT:
        return None
    try:
        key, hashed, _key = record_key(record, 0)
    except (ValueError, struct.error):
        return None
    subject = record_subject(record, 0)
    return _Filed(head.source, hour, entry, hour * HOUR_MS + head.ms_in_hour, key.encode(), subject, hashed)


def _refiled(
    message_id: bytes, entries: list[_Filed], cancelled: dict[bytes, int]
) -> tuple[dict[tuple[str, bytes], bytes], set[bytes]]:
    """The values and key entries filing ``entries`` (all of ``message_id``) in log order gives,
    as ``IdChanges`` and ``StagedStep`` do: the id goes to the entry filed last, the one of
    another subject holding it moves to its displaced key. Which key holds which entry depends
    on the filing order alone; a value's state on whether a kept ``cancelled`` row names it."""
    values: dict[tuple[str, bytes], bytes] = {}
    key_entries: set[bytes] = set()
    holder: tuple[_Filed, bytes] | None = None  # the entry holding the id, its value
    for filed in sorted(entries):
        by = cancelled.get(cancelled_key(filed.hour, filed.entry))
        state, source = (SCHEDULED, filed.source) if by is None else (CANCELLED, by)
        value = IdEntry(filed.deliver_at, filed.entry, source, state, filed.key_hash).pack()
        if filed.key_hash is not None:
            key_entries.add(filed.key_hash + filed.index_key)
        if filed.index_key != message_id:  # a retry's key: its own, never another subject's
            values[(IDS_DB, filed.index_key)] = value
            continue
        if holder is not None and holder[0].subject != filed.subject:
            moved = displaced_key(message_id.decode(), holder[0].subject).encode()
            values[(DISPLACED_DB, moved)] = holder[1]
            if holder[0].key_hash is not None:
                key_entries.add(holder[0].key_hash + moved)
        values[(IDS_DB, message_id)] = value
        holder = (filed, value)
    return values, key_entries


__all__ = ["drop_from"]
