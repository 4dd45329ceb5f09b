"""delaymq.storage: the segmented log, its trio writer, the lmdb state store, format files.

- ``SegmentedLog`` (``delaymq.storage.log``): segment files of envelope records,
  torn-tail recovery, reads by offset.
- ``open_log_writer`` / ``LogWriter`` (``delaymq.storage.writer``): group commit
  from trio under a ``sync`` or ``async`` flush policy.
- ``StateStore`` (``delaymq.storage.state``): lmdb with named dbs, batched writes,
  a map that grows.
- ``delaymq.storage.format``: the FORMAT file beside the data.
"""

from delaymq.storage.errors import (
    AppendFailed,
    BadOffset,
    CorruptLog,
    DirectoryLocked,
    FormatMismatch,
    FormatUnreadable,
    LogClosed,
    LogFailed,
    LogIOError,
    NotRecordStart,
    OffsetBeyondEnd,
    OffsetDeleted,
    RecordTooLarge,
    StateStoreError,
    StorageError,
    StoreClosed,
)
from delaymq.storage.format import read_format
from delaymq.storage.log import Record, SegmentedLog
from delaymq.storage.state import StateStore, WriteBatch
from delaymq.storage.writer import LogWriter, LogWriterStatistics, open_log_writer

__all__ = [
    "AppendFailed",
    "BadOffset",
    "CorruptLog",
    "DirectoryLocked",
    "FormatMismatch",
    "FormatUnreadable",
    "LogClosed",
    "LogFailed",
    "LogIOError",
    "LogWriter",
    "LogWriterStatistics",
    "NotRecordStart",
    "OffsetBeyondEnd",
    "OffsetDeleted",
    "Record",
    "RecordTooLarge",
    "SegmentedLog",
    "StateStore",
    "StateStoreError",
    "StorageError",
    "StoreClosed",
    "WriteBatch",
    "open_log_writer",
    "read_format",
]
