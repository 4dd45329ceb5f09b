"""The scheduler's id index and business-key index (lmdb).

What CANCEL, MOVE, QUERY and the SCHEDULE duplicate check look up (docs/cancel.md).
Two named dbs of the scheduler's lmdb ``StateStore``, written by the replay commit
that files the records they describe (so they move together with the checkpoint)::

    scheduler.ids   key: index key (UTF-8)        value: deliver_at i64, entry u32, source i64,
                                                         state u8 [, key hash 16 bytes]
    scheduler.displaced  key: id NUL NUL subject-hash   value: as scheduler.ids
    scheduler.keys  key: key hash 16 bytes + index key   value: empty
    scheduler.cancelled  key: hour u32, entry u32       value: source i64 (the CANCEL or MOVE record)

The **index key** of a message is its id; a record coming back from a consumer group's
retry (``attempts`` > 0, same id, another subject) is ``id NUL attempts NUL
subject-hash``, as the realtime server's dedup key, so it never takes the original's
place. An id belongs to the message that filed it last: when a message of another
subject files the same id, the one it held moves to ``id NUL NUL subject-hash`` in
``scheduler.displaced`` (``displaced_key``; its key entry follows), so each (subject,
id) keeps one place and duplicates are decided per subject (docs/cancel.md). Filing
decides that in log order from the log and the index alone, so a slave derives the
same keys; only an id the index may hold is looked up (``highest_key``: new
time-ordered ids never are), and the holder's subject is read from its record then.
``entry`` is the entry number in the hour of ``deliver_at``; ``source`` the
message-log offset of the record that last set the value (a re-filed record at or
before it changes nothing: replay after a crash is idempotent); ``state`` scheduled
or cancelled (delivered is what the hour's dispatch log says). The **key hash** is
BLAKE2b-128 of ``subject NUL key``; a lookup by key checks each id's value still
carries it (a re-scheduled id may have another key). Both go when their hour is
deleted (``forget_hour``): the index stays bounded by the hours kept.
``scheduler.cancelled`` holds the entries CANCEL and MOVE records took out of their
hours, so the wheel skips them as it skips delivered ones (``ScheduleStore.delivered``
adds them to the dispatch log's); written in the same commit, it costs no file and no
fsync of its own per hour touched.

The index keys and key hashes are read from the message records, and the CANCEL and
MOVE records encoded and decoded, by ``delaymq.scheduler.indexrecords``; every name of
it is importable from here too.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from delaymq.protocol.envelope import HEADER_SIZE
from delaymq.scheduler.hours import HOUR_MS, INDEX_SUFFIX, LOG_SUFFIX, hour_name
from delaymq.scheduler.indexrecords import (
    CANCEL_KIND,
    DISPLACED_SEPARATOR,
    ID_AT,
    KEY_FIELDS,
    KEY_FIELDS_AT,
    KEY_HASH_SIZE,
    MOVE_KIND,
    cancel_keys,
    cancel_record,
    displaced_key,
    index_key,
    is_displaced,
    key_hash,
    message_id_of,
    move_record,
    move_spans,
    record_index_key,
    record_key,
    record_subject,
    subject_hash,
)
from delaymq.storage.state import StateStore

IDS_DB = "scheduler.ids"
#: Messages whose id a message of another subject filed after them took (``displaced_key``).
DISPLACED_DB = "scheduler.displaced"
KEYS_DB = "scheduler.keys"
CANCELLED_DB = "scheduler.cancelled"

SCHEDULED = 0
CANCELLED = 1

_VALUE = struct.Struct(">qIqB")
#: A ``scheduler.ids`` value without a key hash: deliver_at, entry, source, state.
ID_VALUE = _VALUE
_VALUE_SOURCE_AT = 12  # a value's source, after deliver_at and entry
_ENTRY_HEAD = struct.Struct(">QI")  # a delay index entry's offset and size (docs/scheduler-storage.md)
_ENTRY_SOURCE = struct.Struct(">Q")  # ... and its source, at byte 20
_ENTRY = struct.Struct(">QIIiQI")  # a whole entry: offset, size, ms_in_hour, prev, source, CRC
_ENTRY_SIZE = 32
_NUL2_BYTES = DISPLACED_SEPARATOR
_NUL2 = DISPLACED_SEPARATOR.decode()
_PLACE = struct.Struct(">II")  # a scheduler.cancelled key: hour, entry
_SOURCE = struct.Struct(">q")
#: Deletions per lmdb transaction when an hour goes (a transaction's dirty pages stay in memory).
_DELETE_CHUNK = 20_000


class IdEntry(NamedTuple):
    """One index key's value: where its message is and what became of it."""

    deliver_at: int
    entry: int
    source: int
    state: int
    key_hash: bytes | None

    @property
    def hour(self) -> int:
        return self.deliver_at // HOUR_MS

    def pack(self) -> bytes:
        head = _VALUE.pack(self.deliver_at, self.entry, self.source, self.state)
        return head + self.key_hash if self.key_hash else head

    @classmethod
    def unpack(cls, data: bytes) -> IdEntry:
        deliver_at, entry, source, state = _VALUE.unpack_from(data)
        key_hash = bytes(data[_VALUE.size :]) or None
        return cls(deliver_at, entry, source, state, key_hash)


def db_of(key: bytes) -> str:
    """The db an index key (UTF-8) lives in."""
    return DISPLACED_DB if _NUL2_BYTES in key else IDS_DB


def may_be_displaced(state: StateStore, message_id: bytes) -> bool:
    """Whether ``scheduler.displaced`` may hold a key of ``message_id`` (from memory: its keys
    all sort from ``id NUL NUL``, so above the highest it holds there is none)."""
    try:
        highest = state.highest_key(DISPLACED_DB)
    except KeyError:  # not kept in memory (a store opened without ``keep_highest_key``)
        return True
    return bool(highest) and message_id + _NUL2_BYTES <= highest


def read_entry_head(folder: str | os.PathLike[str], hour: int, entry: int) -> tuple[int, int, int] | None:
    """``(offset, size, source)`` of a delay index entry whose CRC checks, read from its file
    (None: no such entry). Blocking."""
    try:
        with open(Path(folder) / (hour_name(hour) + INDEX_SUFFIX), "rb") as index:
            return _entry_head(index.fileno(), entry)
    except (OSError, ValueError):
        return None


def _entry_head(index_fd: int, entry: int) -> tuple[int, int, int] | None:
    raw = os.pread(index_fd, _ENTRY_SIZE, _ENTRY_SIZE * entry)
    if len(raw) < _ENTRY_SIZE or zlib.crc32(raw[:28]) != int.from_bytes(raw[28:], "big"):
        return None
    offset, size = _ENTRY_HEAD.unpack_from(raw)
    return offset, size, _ENTRY_SOURCE.unpack_from(raw, 20)[0]


def filed_records(folder: str | os.PathLike[str], places: list[tuple[int, int]]) -> list[bytes | None]:
    """The records of filed entries ``(hour, entry)``, each hour's two files opened once
    (None where one is not there). Blocking; for the rare paths that need an indexed
    message's subject."""
    out: list[bytes | None] = [None] * len(places)
    by_hour: dict[int, list[int]] = {}
    for i, (hour, _entry) in enumerate(places):
        by_hour.setdefault(hour, []).append(i)
    for hour, positions in by_hour.items():
        base = Path(folder) / hour_name(hour)
        try:
            with open(str(base) + INDEX_SUFFIX, "rb") as index, open(str(base) + LOG_SUFFIX, "rb") as log_file:
                for i in positions:
                    head = _entry_head(index.fileno(), places[i][1])
                    if head is None:
                        continue
                    offset, size, _source = head
                    record = os.pread(log_file.fileno(), size, offset)
                    out[i] = record if len(record) == size and size > ID_AT else None
        except (OSError, ValueError):
            continue
    return out


def filed_subjects(folder: str | os.PathLike[str], values: list[IdEntry]) -> list[bytes | None]:
    """The subject of the message each index value points to (None: its record cannot be read)."""
    records = filed_records(folder, [(value.hour, value.entry) for value in values])
    return [None if record is None else record_subject(record, 0) for record in records]


def filed_subject(folder: str | os.PathLike[str], value: IdEntry) -> bytes | None:
    """The subject of the message an index value points to (None: its record cannot be read)."""
    return filed_subjects(folder, [value])[0]


def cancelled_key(hour: int, entry: int) -> bytes:
    """The ``scheduler.cancelled`` key of an entry."""
    return _PLACE.pack(hour, entry)


def cancelled_place(key: bytes) -> tuple[int, int]:
    """(hour, entry) of a ``scheduler.cancelled`` key."""
    hour, entry = _PLACE.unpack(key)
    return hour, entry


def cancelled_by(value: bytes) -> int:
    """The message-log offset of the CANCEL or MOVE record a ``scheduler.cancelled`` row names."""
    return int(_SOURCE.unpack(value)[0])


def cancelled_entries(state: StateStore, hour: int) -> list[int]:
    """The entries of ``hour`` cancelled (or moved away) by a filed CANCEL or MOVE record."""
    prefix = hour.to_bytes(4, "big")
    return [_PLACE.unpack(key)[1] for key, _ in state.items(CANCELLED_DB, prefix)]


def cancelled_counts(state: StateStore) -> dict[int, int]:
    """How many entries of each hour ``scheduler.cancelled`` holds (read once, at open)."""
    counts: dict[int, int] = {}
    for key, _ in state.items(CANCELLED_DB):
        hour = int.from_bytes(key[:4], "big")
        counts[hour] = counts.get(hour, 0) + 1
    return counts


# ------------------------------------------------------------------ a replay step's changes


class IdChanges:
    """What one replay step does to the index: values set, keys added, entries cancelled.

    Values are read from lmdb only for cancels, moves and ids the index may already hold
    (filing's ``displace``); a filed message just sets its key's value, packed at once (a
    key hash its id had before stays behind, harmless: lookups check it, and
    ``forget_hour`` removes it). Keys are the index keys' UTF-8 bytes."""

    __slots__ = ("_state", "values", "displaced", "key_entries", "cancelled", "cancelled_puts")

    def __init__(self, state: StateStore) -> None:
        self._state = state
        self.values: dict[bytes, bytes] = {}  # index key -> packed ``IdEntry`` (scheduler.ids)
        self.displaced: dict[bytes, bytes] = {}  # displaced key -> packed ``IdEntry`` (scheduler.displaced)
        self.key_entries: list[bytes] = []
        self.cancelled: dict[int, list[int]] = {}  # hour -> entry numbers cancelled by the step
        self.cancelled_puts: list[tuple[bytes, bytes]] = []  # scheduler.cancelled key, source

    def __bool__(self) -> bool:
        return bool(self.values or self.displaced or self.cancelled)

    def _values_of(self, key: bytes) -> dict[bytes, bytes]:
        return self.displaced if _NUL2_BYTES in key else self.values

    def current(self, key: str, read: dict[bytes, bytes | None] | None = None) -> IdEntry | None:
        """``key``'s value as the step left it (``read``: lmdb's values, read just before)."""
        encoded = key.encode()
        data = self._values_of(encoded).get(encoded)
        if data is None:
            data = read[encoded] if read is not None and encoded in read else self._state.get(db_of(encoded), encoded)
        return None if data is None else IdEntry.unpack(data)

    def read(self, keys: list[str]) -> dict[bytes, bytes | None]:
        """lmdb's values of ``keys`` the step has not set, one transaction per db (for ``cancel``)."""
        wanted = [k for k in (key.encode() for key in keys) if k not in self._values_of(k)]
        found: dict[bytes, bytes | None] = {}
        for db in (IDS_DB, DISPLACED_DB):
            some = [k for k in wanted if db_of(k) == db]
            if some:
                found.update(zip(some, self._state.get_many(db, some)))
        return found

    def stored(self, keys: list[bytes]) -> list[bytes | None]:
        """lmdb's ``scheduler.ids`` values of ``keys`` (ids filing found the index may hold)."""
        return self._state.get_many(IDS_DB, keys)

    def displace(self, key: bytes, value: bytes, subject: bytes) -> None:
        """The message ``value`` describes (of ``subject``) held id ``key`` until a message of
        another subject filed it: it moves to its displaced key, its key entry with it."""
        moved = key + _NUL2_BYTES + subject_hash(subject).encode()
        self.displaced[moved] = value
        hashed = value[_VALUE.size :]
        if hashed:
            self.key_entries.append(hashed + moved)

    def cancel(
        self, key: str, source: int, *, moving: bool = False, read: dict[bytes, bytes | None] | None = None
    ) -> bool:
        """Cancel ``key``'s scheduled entry by the record at ``source``; False if there is none
        or the record was applied before (a value set at or after ``source``)."""
        value = self.current(key, read)
        if value is None or value.state != SCHEDULED or value.source >= source:
            return False
        hour = value.hour
        self.cancelled.setdefault(hour, []).append(value.entry)
        self.cancelled_puts.append((_PLACE.pack(hour, value.entry), _SOURCE.pack(source)))
        if not moving:
            encoded = key.encode()
            self._values_of(encoded)[encoded] = value._replace(state=CANCELLED, source=source).pack()
        return True

    def write(self, batch: object) -> None:
        """Put the step's changes in ``batch`` (keys sorted: lmdb inserts in order fastest)."""
        put_many = batch.put_many  # type: ignore[attr-defined]
        if self.values:
            put_many(IDS_DB, sorted(self.values.items()))
        if self.displaced:
            put_many(DISPLACED_DB, sorted(self.displaced.items()))
        if self.key_entries:
            put_many(KEYS_DB, [(entry, b"") for entry in sorted(self.key_entries)])
        if self.cancelled_puts:
            put_many(CANCELLED_DB, self.cancelled_puts)

    def clear(self) -> None:
        self.values = {}
        self.displaced = {}
        self.key_entries = []
        self.cancelled = {}
        self.cancelled_puts = []


# ------------------------------------------------------------------ reading (blocking)


def lookup(state: StateStore, keys: list[str]) -> list[IdEntry | None]:
    """The values of ``keys`` (None: not in the index), one read transaction per db."""
    encoded = list(map(str.encode, keys))
    if _NUL2 in "\x01".join(keys):  # displaced keys among them (ids hold no control characters)
        found = _get_routed(state, encoded)
    else:
        found = state.get_many(IDS_DB, encoded)
    if not any(found):  # none indexed (every value is at least 21 bytes)
        return found  # type: ignore[return-value]
    unpack = IdEntry.unpack
    return [None if data is None else unpack(data) for data in found]


def _get_routed(state: StateStore, keys: list[bytes]) -> list[bytes | None]:
    """``keys``' values, each read from the db its form names."""
    found: dict[bytes, bytes | None] = {}
    for db in (IDS_DB, DISPLACED_DB):
        some = [k for k in keys if db_of(k) == db]
        if some:
            found.update(zip(some, state.get_many(db, some)))
    return [found[k] for k in keys]


def ids_for_key(state: StateStore, subject: str, key: str) -> list[str]:
    """The index keys filed with (``subject``, ``key``) whose value still carries that key."""
    hashed = key_hash(subject, key)
    keys = [entry[KEY_HASH_SIZE:].decode() for entry, _ in state.items(KEYS_DB, hashed)]
    values = lookup(state, keys)
    return [k for k, v in zip(keys, values) if v is not None and v.key_hash == hashed]


def hour_records(log_path: str, entries: int, *, chunk: int = 8 << 20) -> Iterator[tuple[int, bytes, int]]:
    """``(entry number, buffer, position)`` of each of the first ``entries`` records of a schedule log."""
    with open(log_path, "rb") as file:
        entry = 0
        rest = b""
        while entry < entries:
            data = file.read(chunk)
            if not data:
                return
            buf = rest + data
            pos = 0
            while entry < entries and len(buf) - pos >= HEADER_SIZE:
                size = int.from_bytes(buf[pos : pos + 4], "big")
                end = pos + HEADER_SIZE + size
                if end > len(buf):
                    break
                yield entry, buf, pos
                entry += 1
                pos = end
            rest = buf[pos:]


def forget_hour(state: StateStore, hour: int, log_path: str, entries: int) -> int:
    """Delete the index values of ``hour``'s entries (those still pointing there, under their id
    or displaced) and their key entries, in transactions of ``_DELETE_CHUNK``; returns how many
    values went. Blocking."""
    removed = 0
    pending: list[tuple[str, int, bytes | None, bytes]] = []  # index key, entry, key hash, subject

    def flush() -> None:
        nonlocal removed
        values = lookup(state, [k for k, _n, _h, _s in pending])
        here = [v is not None and v.hour == hour and v.entry == n for v, (_k, n, _h, _s) in zip(values, pending)]
        # A message whose id a later one of another subject took is under its displaced key.
        moved = [
            displaced_key(k, subject) if not found and "\x00" not in k and may_be_displaced(state, k.encode()) else None
            for found, (k, _n, _h, subject) in zip(here, pending)
        ]
        wanted = [d.encode() for d in moved if d is not None]
        got = iter(state.get_many(DISPLACED_DB, wanted) if wanted else [])
        with state.write() as batch:
            for (k, number, hashed, _s), value, found, d in zip(pending, values, here, moved):
                if found:
                    assert value is not None
                    removed += _forget(batch, IDS_DB, k.encode(), value)
                    if value.key_hash == hashed:
                        continue
                elif d is not None:
                    data = next(got)
                    other = None if data is None else IdEntry.unpack(data)
                    if other is not None and other.hour == hour and other.entry == number:
                        removed += _forget(batch, DISPLACED_DB, d.encode(), other)
                if hashed is not None and (value is None or value.key_hash != hashed):
                    batch.delete(KEYS_DB, hashed + k.encode())  # left behind by a re-scheduled or displaced id
        pending.clear()

    try:
        for entry, buf, pos in hour_records(log_path, entries):
            k, hashed, _key = record_key(buf, pos)
            pending.append((k, entry, hashed, record_subject(buf, pos)))
            if len(pending) >= _DELETE_CHUNK:
                flush()
    except FileNotFoundError:
        pass
    if pending:
        flush()
    return removed


def _forget(batch: object, db: str, key: bytes, value: IdEntry) -> int:
    batch.delete(db, key)  # type: ignore[attr-defined]
    if value.key_hash is not None:
        batch.delete(KEYS_DB, value.key_hash + key)  # type: ignore[attr-defined]
    return 1


__all__ = [
    "CANCELLED",
    "CANCELLED_DB",
    "CANCEL_KIND",
    "DISPLACED_DB",
    "DISPLACED_SEPARATOR",
    "IDS_DB",
    "ID_AT",
    "ID_VALUE",
    "KEYS_DB",
    "KEY_FIELDS",
    "KEY_FIELDS_AT",
    "KEY_HASH_SIZE",
    "MOVE_KIND",
    "SCHEDULED",
    "IdChanges",
    "IdEntry",
    "cancel_keys",
    "cancel_record",
    "cancelled_counts",
    "cancelled_entries",
    "cancelled_by",
    "cancelled_key",
    "cancelled_place",
    "db_of",
    "displaced_key",
    "filed_records",
    "filed_subject",
    "filed_subjects",
    "forget_hour",
    "ids_for_key",
    "index_key",
    "is_displaced",
    "key_hash",
    "lookup",
    "may_be_displaced",
    "message_id_of",
    "move_record",
    "move_spans",
    "read_entry_head",
    "record_index_key",
    "record_key",
    "record_subject",
    "subject_hash",
]
