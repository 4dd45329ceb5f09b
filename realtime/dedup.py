"""Which message ids were stored within the dedup window, in bounded memory.

A producer's retry or a scheduler's re-send carries the id of a message already
stored; the realtime server answers "duplicate" and stores it once. A record is
known by its **dedup key** (``dedup_key``): its id and a hash of its subject, and,
for a record that comes back into the log (``attempts`` > 0: a consumer group's
retry or dead letter, same id as the original), its attempts too. So the same id
on another subject is another message (one producer cannot have another's message
dropped by sending its id first), each group's each retry is stored once, however
often a scheduler re-sends it, and the original does not make it a duplicate. The
keys are made from the log's records by the same function on a master, on replay
and on a slave, so nothing about them is replicated. The truth is
in lmdb (written at checkpoints, with the index); memory holds

- ``pending``: ids admitted but not yet committed to lmdb (needed whatever the
  cap: lmdb does not know them yet, replay re-adds them after a crash), and
- ``recent``: committed ids, newest kept, evicted past ``memory_ids`` or the window.

Memory also keeps, for QUERY (``delaymq.realtime.query``), where the batches indexed
lately start in the message log: one ``(stored_at, base, keys)`` per indexed batch
(no copy per record: the keys list is the one the index step was given), the
newest ``memory_ids`` keys' worth within the window; ``locate`` finds an id's batch.

Memory answers alone while it still holds every id of the window
(``covers_from`` is the oldest stored-at time from which it holds all of them);
otherwise ids it does not hold are looked up in lmdb. This class is sans-IO: it
is fed times and lookup results; ``lookup_stored``, ``write_ids`` and ``prune``
are the blocking lmdb parts, run in a worker thread.

lmdb layout (named dbs of the state store)::

    dedup_ids      key: dedup key (UTF-8)          value: stored_at i64 BE
                   (before 2026-12 a first delivery's key was its bare id: while such rows
                   may be within the window, ``bare_ids_until``, a SEND looks its ids up
                   bare too; they are pruned with their bucket)
    dedup_time     key: bucket u64 BE + NUL + stored_at i64 BE + 16-byte BLAKE2b of the value
                                                   value: msgpack array of the batch's dedup keys
                   (before 2026-11-24 a row an id:  key: bucket u64 BE + dedup key, value empty;
                   still read, and pruned, alike)
    dedup_buckets  key: bucket u64 BE              value: empty

with ``bucket = stored_at // BUCKET_MS``, so pruning walks whole expired seconds; a
checkpoint writes one ``dedup_time`` row per indexed batch, not per id.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from bisect import bisect_left
from collections import deque
from collections.abc import Iterable, Sequence
from itertools import groupby, repeat
from operator import itemgetter

import msgpack

from delaymq.protocol.records import MessageBatch
from delaymq.storage.state import StateStore, WriteBatch

BUCKET_MS = 1000
IDS_DB = "dedup_ids"
TIME_DB = "dedup_time"
BUCKETS_DB = "dedup_buckets"
_I64 = struct.Struct(">q")
#: After the bucket in a ``dedup_time`` key: the row lists a batch's ids (no id starts with NUL).
_BATCH_ROW = b"\x00"
_U64 = struct.Struct(">Q")
#: ``covers_from`` when memory holds every id ever stored (a new data folder); as a time, never.
EVERYTHING = -(1 << 62)


@functools.lru_cache(maxsize=16384)
def subject_hash(subject: str) -> str:
    """16 hex digits of the subject's BLAKE2b: a dedup key's subject part, of a fixed size
    whatever the subject's (lmdb keys are at most 511 bytes); remembered for the subjects seen lately."""
    return hashlib.blake2b(subject.encode(), digest_size=8).hexdigest()


def dedup_key(message_id: str, subject: str, attempts: int) -> str:
    """``id NUL subject-hash`` for a first delivery; ``id NUL attempts NUL subject-hash`` for a
    record coming back.

    NUL cannot occur in an id (no control characters), so the two kinds never meet.
    """
    if not attempts:
        return f"{message_id}\x00{subject_hash(subject)}"
    return f"{message_id}\x00{attempts}\x00{subject_hash(subject)}"


def _first_key(message_id: str, subject: str) -> str:
    return message_id + "\x00" + subject_hash(subject)


def dedup_keys(batch: MessageBatch) -> list[str]:
    """Every record's ``dedup_key``, in order.

    The hot path of every SEND: a batch of one subject (a scheduler's, a benchmark's)
    costs one string concatenation a record."""
    ids, subjects, attempts = batch.ids, batch.subjects, batch.attempts
    if any(attempts):
        return list(map(dedup_key, ids, subjects, attempts))
    if not subjects:
        return []
    if subjects.count(subjects[0]) == len(subjects):
        suffix = "\x00" + subject_hash(subjects[0])
        return [message_id + suffix for message_id in ids]
    return list(map(_first_key, ids, subjects))


def message_id_of(key: str) -> str | None:
    """The message id of a first delivery's dedup key (None for a retry's or dead letter's)."""
    message_id, _sep, rest = key.partition("\x00")
    return None if "\x00" in rest else message_id


class DedupWindow:
    """Stored ids of the last ``window_ms``; see the module docstring.

    Kept a batch at a time, so the per-id work stays in C (``dict.update``, ``isdisjoint``):
    ``_known`` maps every id memory holds to when it was stored (or admitted, while its
    append is under way), and ``_batches`` lists the indexed batches oldest first, whose
    first ``_committed`` are in lmdb and may be evicted. Batches are committed in the order
    they were indexed (checkpoints take them in order and give back a failed one whole), so
    the committed ones are always a prefix.
    """

    def __init__(self, *, window_ms: int, memory_ids: int, covers_from: int) -> None:
        if window_ms <= 0:
            raise ValueError(f"dedup_window_ms must be positive, got {window_ms}")
        if memory_ids <= 0:
            raise ValueError(f"dedup memory_ids must be positive, got {memory_ids}")
        self.window_ms = window_ms
        self.memory_ids = memory_ids
        self.covers_from = covers_from
        self._known: dict[str, int] = {}
        #: (stored_at, base or None when loaded from lmdb, keys), oldest first.
        self._batches: deque[tuple[int, int | None, list[str]]] = deque()
        self._committed = 0  # how many of ``_batches``, from the left, are in lmdb
        self._committed_keys = 0  # and their keys
        self._unpersisted: list[tuple[list[str], int]] = []
        #: Until when rows keyed by a bare message id may be within the window (``bare_ids_until``).
        self.bare_ids_until = EVERYTHING

    def __len__(self) -> int:
        return len(self._known)

    def to_look_up(self, ids: Sequence[str], now: int) -> list[str]:
        """The ids memory cannot settle at ``now``: look them up with ``lookup_stored``."""
        if now - self.window_ms >= self.covers_from:
            return []
        known = self._known
        return [message_id for message_id in ids if message_id not in known]

    def admit(self, ids: Sequence[str], now: int, stored: Iterable[str] = ()) -> list[bool]:
        """Which records are new (True) or duplicates (False); new ids become pending.

        ``stored`` holds the ids lmdb reported stored within the window. A second
        record with the same id in one batch is a duplicate of the first.
        """
        known = self._known
        stored = set(stored)
        if not stored and known.keys().isdisjoint(ids) and len(set(ids)) == len(ids):
            known.update(zip(ids, repeat(now)))  # the usual batch: every id new
            return [True] * len(ids)
        oldest = now - self.window_ms
        fresh: list[bool] = []
        for message_id in ids:
            stored_at = known.get(message_id)
            if (stored_at is not None and stored_at > oldest) or message_id in stored:
                fresh.append(False)
            else:
                known[message_id] = now
                fresh.append(True)
        return fresh

    def stored_bare(self, ids: Sequence[str], now: int) -> tuple[set[str], dict[str, list[str]]]:
        """Rows written before keys held the subject (a first delivery keyed by its bare id): the
        keys of ``ids`` whose bare id memory holds within the window, and the bare ids memory
        cannot settle, with their keys (look them up with ``lookup_stored``). A bare row names
        no subject: it answers for the id on every subject, as it did when written."""
        known = self._known
        oldest = now - self.window_ms
        covered = oldest >= self.covers_from
        stored: set[str] = set()
        unsure: dict[str, list[str]] = {}
        for key in ids:
            message_id = message_id_of(key)
            if message_id is None:
                continue  # a retry's or dead letter's key: its form did not change
            stored_at = known.get(message_id)
            if stored_at is not None and stored_at > oldest:
                stored.add(key)
            elif not covered:
                unsure.setdefault(message_id, []).append(key)
        return stored, unsure

    def forget(self, ids: Iterable[str]) -> None:
        """Admitted ids whose records were not stored after all (the append failed)."""
        for message_id in ids:
            self._known.pop(message_id, None)

    def indexed(self, ids: list[str], stored_at: int, base: int | None = None) -> None:
        """Stored and indexed (their records back to back from message-log offset ``base``):
        to be committed with the next checkpoint."""
        if not ids:
            return
        self._known.update(zip(ids, repeat(stored_at)))
        self._unpersisted.append((ids, stored_at))
        self._batches.append((stored_at, base, ids))

    def recent(self, now: int) -> list[tuple[int, int, list[str]]]:
        """``(stored_at, base, keys)`` of the batches within the window whose place in the log
        memory knows, newest first: a copy, for ``locate`` in a worker thread."""
        oldest = now - self.window_ms
        out: list[tuple[int, int, list[str]]] = []
        for stored_at, base, keys in reversed(self._batches):
            if stored_at <= oldest:
                break
            if base is not None:
                out.append((stored_at, base, keys))
        return out

    def take_unpersisted(self) -> list[tuple[list[str], int]]:
        """The batches of ids for the next checkpoint, ``(ids, stored_at)`` each, oldest first
        (give them to ``committed`` once written, or back to ``restore_unpersisted``)."""
        taken, self._unpersisted = self._unpersisted, []
        return taken

    def committed(self, batches: Sequence[tuple[list[str], int]], now: int) -> None:
        """These batches (the oldest not committed yet) are in lmdb: they may be evicted now."""
        self._committed += len(batches)
        self._committed_keys += sum(len(ids) for ids, _ in batches)
        self.evict(now)

    def evict(self, now: int) -> None:
        """Forget committed batches stored at ``now - window_ms`` or before, and the oldest ones
        while more than ``memory_ids`` committed ids are held (then memory no longer covers
        the whole window: ``covers_from`` moves past them)."""
        oldest = now - self.window_ms
        batches, known = self._batches, self._known
        while self._committed and (batches[0][0] <= oldest or self._committed_keys > self.memory_ids):
            stored_at, _base, ids = batches.popleft()
            self._committed -= 1
            self._committed_keys -= len(ids)
            for message_id in ids:
                if known.get(message_id) == stored_at:
                    del known[message_id]
            if stored_at > oldest:  # evicted for the cap, not expired
                self.covers_from = max(self.covers_from, stored_at + 1)

    def load(self, entries: list[tuple[str, int]], covers_from: int) -> None:
        """Committed ids read back at start-up (oldest first), holding every id from ``covers_from``."""
        for stored_at, group in groupby(entries, key=itemgetter(1)):
            ids = [message_id for message_id, _ in group]
            self._known.update(zip(ids, repeat(stored_at)))
            self._batches.append((stored_at, None, ids))
            self._committed += 1
            self._committed_keys += len(ids)
        self.covers_from = covers_from

    def restore_unpersisted(self, batches: list[tuple[list[str], int]]) -> None:
        """A checkpoint failed: its batches go into the next one."""
        self._unpersisted[:0] = batches


def locate(batches: Sequence[tuple[int, int, list[str]]], ids: Iterable[str]) -> dict[str, tuple[int, int, int]]:
    """``id -> (stored_at, base, index)`` of the first deliveries of ``ids`` in ``batches``
    (``DedupWindow.recent``: the record is the ``index``-th from offset ``base``), the newest
    when an id came twice (on several subjects too). A walk over every key held (QUERY only):
    run it in a worker thread."""
    wanted = set(ids)
    found: dict[str, tuple[int, int, int]] = {}
    for stored_at, base, keys in batches:
        if not wanted:
            break
        for index, key in enumerate(keys):
            message_id = message_id_of(key)
            if message_id in wanted:
                wanted.discard(message_id)
                found[message_id] = (stored_at, base, index)
    return found


# ------------------------------------------------------------ lmdb (blocking)


def lookup_stored(store: StateStore, ids: Iterable[str], since: int) -> set[str]:
    """The ids lmdb holds with a stored-at time after ``since``."""
    ids = list(ids)
    values = store.get_many(IDS_DB, [message_id.encode() for message_id in ids])
    return {message_id for message_id, value in zip(ids, values) if value is not None and _I64.unpack(value)[0] > since}


def write_ids(batch: WriteBatch, batches: Iterable[tuple[list[str], int]]) -> set[int]:
    """Add batches of ids to a checkpoint's write batch; returns the buckets written.

    Each id gets its ``dedup_ids`` row; each batch one ``dedup_time`` row listing its ids."""
    pack_i64, pack_u64 = _I64.pack, _U64.pack
    id_rows: list[tuple[bytes, bytes]] = []
    time_rows: list[tuple[bytes, bytes]] = []
    buckets: set[int] = set()
    for ids, stored_at in batches:
        keys = [message_id.encode() for message_id in ids]
        value = pack_i64(stored_at)
        id_rows += zip(keys, repeat(value))
        bucket = max(stored_at // BUCKET_MS, 0)
        buckets.add(bucket)
        # Named by its contents: two batches of one stored_at (a replay stamps a whole step with
        # one time) share a row only when they list the same ids, so no row hides another's.
        listed = msgpack.packb(keys)
        time_rows.append(
            (pack_u64(bucket) + _BATCH_ROW + value + hashlib.blake2b(listed, digest_size=16).digest(), listed)
        )
    batch.put_many(IDS_DB, id_rows)
    batch.put_many(TIME_DB, time_rows)
    for bucket in buckets:
        batch.put(BUCKETS_DB, pack_u64(bucket), b"")
    return buckets


def _bucket_keys(store: StateStore, bucket: int) -> list[tuple[bytes, bytes]]:
    """``(dedup_time row key, dedup key)`` of each id of ``bucket``, from rows of either form:
    a batch's (``_BATCH_ROW`` after the bucket: its ids in the value) or one id's (the id in
    the key; written before batches had rows)."""
    keys: list[tuple[bytes, bytes]] = []
    for row_key, value in store.items(TIME_DB, _U64.pack(bucket)):
        if row_key[8:9] == _BATCH_ROW:
            keys += zip(repeat(row_key), msgpack.unpackb(value))
        else:
            keys.append((row_key, row_key[8:]))
    return keys


def load_buckets(store: StateStore) -> list[int]:
    return sorted(_U64.unpack(key)[0] for key, _ in store.items(BUCKETS_DB))


def bare_ids_until(store: StateStore, buckets: list[int], now: int, window_ms: int) -> int:
    """Until when a SEND must look its ids up bare too (start-up, blocking): ``now + window_ms``
    if the oldest bucket within the window holds a key without NUL (a first delivery's key before
    keys held the subject), else ``EVERYTHING`` (never). Such rows are older than any other,
    so the oldest bucket tells; one bucket is read."""
    first = bisect_left(buckets, (now - window_ms) // BUCKET_MS)
    if first == len(buckets):
        return EVERYTHING
    if any(b"\x00" not in key for _row, key in _bucket_keys(store, buckets[first])):
        return now + window_ms
    return EVERYTHING


def load_recent(
    store: StateStore, buckets: list[int], now: int, window_ms: int, memory_ids: int
) -> tuple[list[tuple[str, int]], int]:
    """The newest ids of the window (at most ``memory_ids``), oldest first, and their coverage.

    Returns ``(entries, covers_from)``: memory loaded with ``entries`` holds every id
    stored at or after ``covers_from``.
    """
    oldest = now - window_ms
    loaded: list[list[tuple[str, int]]] = []
    count = 0
    covers_from = EVERYTHING
    for bucket in reversed(buckets):
        if (bucket + 1) * BUCKET_MS <= oldest:
            break  # this bucket and older ones are expired
        keys = [key for _row, key in _bucket_keys(store, bucket)]
        if count + len(keys) > memory_ids:
            covers_from = (bucket + 1) * BUCKET_MS
            break
        entries = []
        values = store.get_many(IDS_DB, keys)
        for key, value in zip(keys, values):
            if value is not None:
                stored_at = _I64.unpack(value)[0]
                if stored_at > oldest:
                    entries.append((key.decode(), stored_at))
        entries.sort(key=lambda entry: entry[1])
        loaded.append(entries)
        count += len(keys)
    return [entry for entries in reversed(loaded) for entry in entries], covers_from


def prune(store: StateStore, buckets: list[int], now: int, window_ms: int, *, max_buckets: int = 16) -> int:
    """Delete ids of up to ``max_buckets`` expired buckets from ``buckets`` (sorted, mutated).

    Returns how many ids were deleted. An id stored again later (after its
    window) lives in a newer bucket and is kept.
    """
    deleted = 0
    expired_before = (now - window_ms) // BUCKET_MS  # buckets below are wholly expired
    done = 0
    with store.write() as batch:
        while buckets and buckets[0] < expired_before and done < max_buckets:
            bucket = buckets.pop(0)
            rows: set[bytes] = set()
            for row_key, message_id in _bucket_keys(store, bucket):
                value = batch.get(IDS_DB, message_id)
                if value is not None and _I64.unpack(value)[0] // BUCKET_MS <= bucket:
                    batch.delete(IDS_DB, message_id)
                    deleted += 1
                rows.add(row_key)
            for row_key in rows:
                batch.delete(TIME_DB, row_key)
            batch.delete(BUCKETS_DB, _U64.pack(bucket))
            done += 1
    return deleted


__all__ = [
    "BUCKET_MS",
    "EVERYTHING",
    "DedupWindow",
    "bare_ids_until",
    "dedup_key",
    "dedup_keys",
    "locate",
    "message_id_of",
    "subject_hash",
    "load_buckets",
    "load_recent",
    "lookup_stored",
    "prune",
    "write_ids",
]
