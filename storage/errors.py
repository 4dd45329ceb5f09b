"""The storage layer's errors: one hierarchy, each naming what was wrong and the limit."""

from __future__ import annotations

import errno
from collections.abc import Sequence
from pathlib import Path

from delaymq.protocol.errors import RemoteProtocolError

#: ``errno`` values that mean the file system (or the user's quota) has no space left.
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


class StorageError(Exception):
    """Base of every error the storage layer raises on purpose."""


class FormatMismatch(StorageError):
    """Data on disk was written with other format parameters than the ones asked for.

    ``differences`` holds ``(name, stored, requested)`` for each differing parameter;
    ``None`` means "absent".
    """

    def __init__(self, directory: Path, differences: Sequence[tuple[str, object, object]]) -> None:
        self.directory = directory
        self.differences = list(differences)
        detail = "; ".join(
            f"{name}: stored {_show(stored)}, requested {_show(requested)}"
            for name, stored, requested in self.differences
        )
        super().__init__(f"{directory} holds data written with other format parameters ({detail})")


def _show(value: object) -> str:
    return "absent" if value is None else repr(value)


class FormatUnreadable(StorageError):
    """The format file is missing where data exists, or does not parse."""


class DirectoryLocked(StorageError):
    """Another open log or store (in this process or another) holds the folder."""


class LogClosed(StorageError):
    """The log or writer was used after ``close()``."""


class LogFailed(StorageError):
    """An earlier write or fsync failed, so the log refuses more appends until reopened.

    After a failed fsync the kernel may have dropped the dirty pages, so carrying
    on would acknowledge records that are not on disk.
    """


class LogIOError(StorageError):
    """An append or flush failed at the operating system (disk full, I/O error)."""


class AppendFailed(StorageError):
    """A ``LogWriter.append`` did not become durable; ``__cause__`` says why."""


class RecordTooLarge(StorageError):
    """A record's payload exceeds the log's ``max_record``."""


class CorruptLog(StorageError):
    """The log's files are inconsistent in a way recovery must not guess about."""


class BadOffset(StorageError):
    """A read at an offset that does not hold a record.

    ``start_offset`` and ``end_offset`` give the log's valid range at the time.
    """

    def __init__(self, message: str, offset: int, start_offset: int, end_offset: int) -> None:
        super().__init__(f"{message} (the log holds offsets [{start_offset}, {end_offset}))")
        self.offset = offset
        self.start_offset = start_offset
        self.end_offset = end_offset


class OffsetBeyondEnd(BadOffset):
    """The offset is at or past the end of the log."""


class OffsetDeleted(BadOffset):
    """The offset lies in a segment already deleted by ``delete_before``."""


class NotRecordStart(BadOffset):
    """The offset is inside the log but no intact record starts there."""


class StateStoreError(StorageError):
    """A refusal from the lmdb state store (key too long, map limit reached...)."""


class StoreIOError(StateStoreError):
    """A write transaction failed at the operating system (disk full, I/O error); none of it is written.

    The store stays usable: the same write succeeds once the cause is gone.
    """


class StoreClosed(StateStoreError):
    """The state store was used after ``close()``."""


def disk_full(error: BaseException | None) -> bool:
    """Whether ``error``, or an error that led to it, is the file system running out of space."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError) and error.errno in DISK_FULL_ERRNOS:
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def describe(error: BaseException) -> str:
    """``error`` for a log line or an answer: says "the disk is full" first when it is."""
    text = str(error) or type(error).__name__
    return f"the disk is full ({text})" if disk_full(error) else text


def storage_refusal(what: str, error: BaseException) -> RemoteProtocolError:
    """The answer to a request whose data could not be stored: ``unavailable``, so the client retries.

    ``what`` names the request and the step ("SEND: the message log could not
    store the batch"). Nothing of the request was stored, so a retry (here once
    space is freed, or at another group) stores it.
    """
    return RemoteProtocolError(f"{what}: {describe(error)}; nothing of it was stored, retry", code="unavailable")
