"""The servers' on-disk formats, as the backlog job reads them: every import from the
server packages lives here.

The job reuses the servers' own definitions (entry layouts, file suffixes, lmdb
database names and keys, the record header, the realtime checkpoint loader) rather
than restating them, read-only: nothing here writes a data folder. When the server
packages are reorganised, this is the one file whose imports change.

Layouts: docs/scheduler-storage.md, docs/realtime-storage.md, docs/records-and-logs.md.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lmdb

from delaymq.protocol.envelope import (
    HEADER_SIZE,
    CorruptRecord,
    RecordKind,
    Span,
    TruncatedRecord,
    iter_spans,
    valid_prefix,
)
from delaymq.protocol.records import RECORD_HEADER, RECORD_HEADER_SIZE
from delaymq.protocol.subjects import DEAD_PREFIX, RETRY_PREFIX, SEPARATOR
from delaymq.realtime.checkpoint import LoadedState, load_state
from delaymq.realtime.consumelog import CONSUME_FORMAT, entry_time, subject_stem
from delaymq.realtime.consumelog import ENTRY as CONSUME_ENTRY
from delaymq.realtime.consumelog import ENTRY_SIZE as CONSUME_ENTRY_SIZE
from delaymq.realtime.pulllog import PULL_ENTRY, PULL_ENTRY_SIZE, PULL_FORMAT
from delaymq.scheduler.delayindex import CHECKPOINT_KEY, HOURS_DB, INDEX_VERSION, REPLAY_DB, HourSummary, record_problem
from delaymq.scheduler.delayindex import ENTRY as INDEX_ENTRY
from delaymq.scheduler.delayindex import ENTRY_SIZE as INDEX_ENTRY_SIZE
from delaymq.scheduler.hours import DISPATCH_SUFFIX, HOUR_MS, INDEX_SUFFIX, LOG_SUFFIX, hour_name, parse_hour_name
from delaymq.scheduler.schedulelog import STORE_FORMAT, STORE_FORMAT_VERSION
from delaymq.storage.log import SEGMENT_NAME_DIGITS, segment_name

#: Sub-folders of a scheduler's data folder (``delaymq.scheduler.server``).
SCHEDULER_MESSAGES = "messages"
SCHEDULER_STATE = "state"
SCHEDULE = "schedule"
#: Sub-folders of a realtime server's data folder (docs/realtime-storage.md).
REALTIME_MESSAGES = "messages"
REALTIME_STATE = "state"
CONSUME = "consume"
PULL = "pull"

#: What a schedule folder's FORMAT must say for the job to read it.
SCHEDULE_FORMAT = {"format": STORE_FORMAT, "version": STORE_FORMAT_VERSION, "index_version": INDEX_VERSION,
                   "index_entry_size": INDEX_ENTRY_SIZE}  # fmt: skip

_DISPATCH = int(RecordKind.DISPATCH)
#: The envelope kind of a message record.
MESSAGE_KIND = int(RecordKind.MESSAGE)
_BIG_ENDIAN = sys.byteorder == "big"
_MAX_DBS = 64

__all__ = [
    "CONSUME",
    "CorruptRecord",
    "Span",
    "TruncatedRecord",
    "iter_spans",
    "CONSUME_ENTRY",
    "CONSUME_ENTRY_SIZE",
    "CONSUME_FORMAT",
    "entry_time",
    "DEAD_PREFIX",
    "DISPATCH_SUFFIX",
    "HEADER_SIZE",
    "HOUR_MS",
    "INDEX_ENTRY",
    "INDEX_ENTRY_SIZE",
    "INDEX_SUFFIX",
    "LOG_SUFFIX",
    "MESSAGE_KIND",
    "REALTIME_MESSAGES",
    "REALTIME_STATE",
    "SCHEDULER_MESSAGES",
    "SCHEDULER_STATE",
    "local_copy",
    "PULL",
    "PULL_ENTRY",
    "PULL_ENTRY_SIZE",
    "PULL_FORMAT",
    "RECORD_HEADER",
    "RECORD_HEADER_SIZE",
    "RETRY_PREFIX",
    "SCHEDULE",
    "SCHEDULE_FORMAT",
    "SEPARATOR",
    "LoadedState",
    "ReadOnlyState",
    "dispatched_bitmap",
    "hour_name",
    "is_segment_name",
    "open_state",
    "parse_hour_name",
    "record_problem",
    "scheduler_state",
    "segment_name",
    "subject_stem",
    "realtime_state",
]


def is_segment_name(name: str) -> bool:
    """A segmented-log segment file: its first offset in 20 digits."""
    return len(name) == SEGMENT_NAME_DIGITS and name.isdigit()


# --------------------------------------------------------------------- dispatch logs


def dispatched_bitmap(data: bytes) -> tuple[bytearray, int, str]:
    """The entries a dispatch log's bytes mark delivered, as a bitmap (bit ``n`` of byte
    ``n >> 3``), with how far the records check and why they stop there ("" when whole).

    The dispatch log's records (envelope, kind DISPATCH, u32 entry numbers) are the ones
    ``delaymq.scheduler.dispatchlog`` writes; like its loader, a torn tail ends the log.
    """
    valid, error = valid_prefix(data)
    bitmap = bytearray()
    for span in iter_spans(data, 0, valid):
        size = span.end - span.start - HEADER_SIZE
        if span.kind != _DISPATCH or size % 4:
            return (
                bitmap,
                span.start,
                f"record of kind {span.kind} and {size} bytes is not a DISPATCH record of u32 entries",
            )
        numbers = array("I")
        numbers.frombytes(data[span.start + HEADER_SIZE : span.end])
        if not _BIG_ENDIAN:
            numbers.byteswap()
        if numbers:
            need = (max(numbers) >> 3) + 1
            if need > len(bitmap):
                bitmap.extend(bytes(need - len(bitmap)))
            for n in numbers:
                bitmap[n >> 3] |= 1 << (n & 7)
    return bitmap, valid, "" if error is None else error.reason


# --------------------------------------------------------------------- lmdb, read only


class ReadOnlyState:
    """A server's lmdb state read in one read transaction: one consistent snapshot of
    what its last commit holds, taken beside the running server (no lock of its folder).

    Offers the reading half of ``delaymq.storage.state.StateStore`` (``get``, ``items``),
    so the servers' own loaders (``realtime.checkpoint.load_state``) read it.
    """

    def __init__(self, env: lmdb.Environment, txn: lmdb.Transaction) -> None:
        self._env = env
        self._txn = txn
        self._dbs: dict[str, Any] = {}

    def _db(self, name: str) -> Any | None:
        if name not in self._dbs:
            try:
                self._dbs[name] = self._env.open_db(name.encode(), txn=self._txn, create=False)
            except lmdb.NotFoundError:
                self._dbs[name] = None
        return self._dbs[name]

    def get(self, db: str, key: bytes) -> bytes | None:
        handle = self._db(db)
        value = None if handle is None else self._txn.get(bytes(key), db=handle)
        return None if value is None else bytes(value)

    def items(self, db: str, prefix: bytes = b"") -> list[tuple[bytes, bytes]]:
        handle = self._db(db)
        if handle is None:
            return []
        cursor = self._txn.cursor(db=handle)
        found: list[tuple[bytes, bytes]] = []
        if cursor.set_range(prefix):
            for key, value in cursor:
                if not bytes(key).startswith(prefix):
                    break
                found.append((bytes(key), bytes(value)))
        return found


@contextmanager
def open_state(directory: Path) -> Iterator[ReadOnlyState | None]:
    """The lmdb state in ``directory`` read only (None when there is none).

    A live server's folder is read with lmdb's reader lock, so the snapshot is one
    committed transaction; a folder we may not lock (read-only media) is read without.
    """
    if not (directory / "data.mdb").exists():
        yield None
        return
    env = None
    for lock in (True, False):
        try:
            env = lmdb.open(str(directory), readonly=True, lock=lock, max_dbs=_MAX_DBS, subdir=True, create=False)
            break
        except lmdb.Error:
            if not lock:
                raise
    assert env is not None
    try:
        try:
            txn = env.begin(buffers=False)
        except lmdb.MapResizedError:  # the server grew its map since we opened
            env.set_mapsize(0)
            txn = env.begin(buffers=False)
        try:
            yield ReadOnlyState(env, txn)
        finally:
            txn.abort()
    finally:
        env.close()


@contextmanager
def local_copy(data_mdb: bytes) -> Iterator[Path]:
    """A temporary folder holding ``data.mdb`` (an lmdb fetched from a remote path)."""
    folder = Path(tempfile.mkdtemp(prefix="delaymq-backlog-state-"))
    try:
        (folder / "data.mdb").write_bytes(data_mdb)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def scheduler_state(state: ReadOnlyState | None) -> tuple[dict[int, tuple[int, int]], int]:
    """Committed ``{hour: (entries, log_end)}`` and the replay checkpoint of a scheduler."""
    if state is None:
        return {}, 0
    summaries = {}
    for key, value in state.items(HOURS_DB):
        summary = HourSummary.unpack(value)
        summaries[int.from_bytes(key, "big")] = (summary.entries, summary.log_end)
    raw = state.get(REPLAY_DB, CHECKPOINT_KEY)
    return summaries, int.from_bytes(raw, "big") if raw is not None else 0


def realtime_state(state: ReadOnlyState | None) -> LoadedState | None:
    """A realtime server's last checkpoint (index offset, consume counts, shares, consumers)."""
    return None if state is None else load_state(state)  # type: ignore[arg-type]
