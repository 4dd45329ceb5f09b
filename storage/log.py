"""The segmented log: a folder of segment files holding envelope records end to end.

Offsets are global byte positions (as in RocketMQ's commit log): a segment file is
named by the offset of its first byte, in 20 zero-padded digits, and holds records
that never span two segments. A batch goes to disk in one ``os.pwrite``; a batch
that would push the active segment past ``segment_size`` starts a new segment (a
batch bigger than a segment gets one of its own).

Crash safety rests on two rules: a segment is fsynced before the next one is
created, so only the last segment can have a torn tail; and on open that tail is
cut at the first record that does not check (envelope size, magic, version, CRC).
The open checks only what no earlier process vouched for: the log keeps its
*verified end* (``delaymq.storage.verified``), below which every byte is a whole,
fsynced record, moved on by a flush once it is ``checkpoint_bytes`` behind, so
an open reads at most about that much plus the unflushed tail, not the whole last
segment. Bytes below it are trusted as older segments always were: damage there
(a bad disk) is found by the read that meets it (``NotRecordStart``). A verified
end that does not check, or no longer matches the segment, is ignored (logged)
and the whole last segment is checked.
A write that fails (a full disk) is cut back at once, so no torn record is ever
followed by later ones; after a failed fsync the log refuses appends until it is
reopened or its owner cuts the unflushed tail (``drop_unflushed``).

Threads: one thread appends and flushes while readers run in others (the event
loop included). ``end_offset`` moves only after a write has returned, so a reader
never sees a half-written record; the segment index is replaced, never mutated,
so a reader's snapshot of it stays consistent. Blocking calls are meant to run
through a ``run_blocking`` (``delaymq.storage.threads``); ``delaymq.storage.writer``
does that for appends.

Its parts: settings and their FORMAT parameters (``delaymq.storage.log_settings``),
segment files and their names (``delaymq.storage.segment``), the open's check and
cut of the tail (``delaymq.storage.recovery``), reads by offset
(``delaymq.storage.reads``) and the verified end's moves (``VerifiedEndKeeper``
in ``delaymq.storage.verified``). This module holds appends, flushes, cuts and the
log's life cycle; it exports every name code outside ``delaymq.storage`` reads.
"""

from __future__ import annotations

import logging
import os
import threading
from bisect import bisect_right
from collections.abc import Mapping

from delaymq.protocol.envelope import HEADER, HEADER_SIZE, encode
from delaymq.storage.errors import (
    LogClosed,
    LogFailed,
    LogIOError,
    OffsetBeyondEnd,
    OffsetDeleted,
    RecordTooLarge,
)
from delaymq.storage.files import pwrite_all
from delaymq.storage.folder import DataFolder
from delaymq.storage.format import FormatValue, ensure_format
from delaymq.storage.log_settings import (
    DEFAULT_CHECKPOINT_BYTES,
    DEFAULT_MAX_RECORD,
    DEFAULT_SEGMENT_SIZE,
    LOG_FORMAT,
    LOG_FORMAT_VERSION,
    check_max_record,
    format_params,
)
from delaymq.storage.reads import ReadableLog, Record
from delaymq.storage.recovery import Recovery, recover_segments
from delaymq.storage.segment import SEGMENT_NAME_DIGITS, Segment, create_segment_file, segment_bases, segment_name
from delaymq.storage.verified import VerifiedEndFile, VerifiedEndKeeper, read_verified

__all__ = [
    "DEFAULT_CHECKPOINT_BYTES",
    "DEFAULT_MAX_RECORD",
    "DEFAULT_SEGMENT_SIZE",
    "LOG_FORMAT",
    "LOG_FORMAT_VERSION",
    "SEGMENT_NAME_DIGITS",
    "Record",
    "Recovery",
    "SegmentedLog",
    "check_max_record",
    "segment_bases",
    "segment_name",
]

_logger = logging.getLogger(__name__)


class SegmentedLog(ReadableLog):
    """An append-only log of envelope records in segment files. Use ``SegmentedLog.open``."""

    def __init__(
        self,
        folder: DataFolder,
        segments: list[Segment],
        *,
        segment_size: int,
        max_record: int,
        verified: VerifiedEndKeeper,
        recovery: Recovery,
    ) -> None:
        super().__init__(folder, segments, max_record=max_record)
        self._segment_size = segment_size
        self._verified = verified
        self.recovery = recovery
        self._active = segments[-1]
        self._flushed = self._end
        self._append_lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._index_lock = threading.Lock()  # replacing _index (readers take no lock)
        self._failure: BaseException | None = None

    # ------------------------------------------------------------------ opening

    @classmethod
    def open(
        cls,
        directory: str | os.PathLike[str],
        *,
        segment_size: int = DEFAULT_SEGMENT_SIZE,
        max_record: int = DEFAULT_MAX_RECORD,
        extra_format: Mapping[str, FormatValue] | None = None,
        checkpoint_bytes: int = DEFAULT_CHECKPOINT_BYTES,
    ) -> SegmentedLog:
        """Open (or create) the log in ``directory``, cutting a torn tail.

        ``max_record`` is the largest payload a record may have; recovery reads a
        bigger size field as corruption. It and ``segment_size`` are stored in the
        folder's FORMAT file, with ``extra_format`` (a caller's own parameters),
        and a later open with other values raises ``FormatMismatch``.
        ``checkpoint_bytes``: how far the flushed end may run ahead of the saved
        verified end (what the next open checks again at most, besides the
        unflushed tail); each save costs one small write and ``fdatasync``.
        """
        params = format_params(segment_size, max_record, checkpoint_bytes, extra_format)
        folder = DataFolder(directory, what="segmented log")
        try:
            bases = segment_bases(folder.path)
            ensure_format(folder.path, params, has_data=bool(bases))
            stored, damaged = read_verified(folder.path)
            segments, recovery = recover_segments(folder, bases, max_record, stored, damaged)
        except BaseException:
            folder.close()
            raise
        verified = VerifiedEndKeeper(
            VerifiedEndFile(folder.path, stored, fsync_folder=folder.fsync),
            recovery.verified_end,
            checkpoint_bytes=checkpoint_bytes,
            log_path=folder.path,
        )
        last = segments[-1]
        try:
            verified.vouch_after_open(last.fd, last.base, last.end, distrusted=recovery.distrusted is not None)
        except BaseException:
            verified.close()
            for segment in segments:
                segment.close()
            folder.close()
            raise
        return cls(
            folder,
            segments,
            segment_size=segment_size,
            max_record=max_record,
            verified=verified,
            recovery=recovery,
        )

    # --------------------------------------------------------------- properties

    @property
    def segment_size(self) -> int:
        return self._segment_size

    @property
    def flushed_offset(self) -> int:
        """Every byte below this has been fsynced."""
        return self._flushed

    @property
    def verified_end(self) -> int:
        """The saved verified end: the next open checks only the records after it."""
        return self._verified.end

    @property
    def failed(self) -> bool:
        """An fsync (or the cut after a failed write) failed: appends are refused (see ``drop_unflushed``)."""
        return self._failure is not None

    # ---------------------------------------------------------------- appending

    def append(self, data: bytes | bytearray | memoryview, *, at: int | None = None) -> int:
        """Append whole records (a batch the caller has checked) in one write.

        Returns the offset of the batch's first byte. On a failed write the
        segment is cut back to where it was and ``LogIOError`` is raised. ``at``:
        the offset the batch must start at (a replica copying its master's bytes);
        ``OffsetBeyondEnd`` if the log ends elsewhere, checked under the append lock.
        """
        size = len(data)
        if size == 0:
            raise ValueError("data is empty: append takes one or more whole records")
        with self._append_lock:
            self._check_usable()
            if at is not None and at != self._end:
                raise OffsetBeyondEnd(
                    f"the batch is for offset {at} but the log ends at {self._end}", at, self.start_offset, self._end
                )
            if size > self._max_record + HEADER_SIZE:
                self._check_record_sizes(data)
            segment = self._active
            if segment.size and segment.size + size > self._segment_size:
                segment = self._roll()
            offset = segment.end
            self._write(segment, data, offset)
            segment.size += size
            if self._recent is not None and at is None:  # not a replica's copy: read back with CRCs
                self._recent.add(offset, data)
            self._end = offset + size  # publish only once the bytes are written
            return offset

    def append_record(self, kind: int, payload: bytes | bytearray | memoryview) -> int:
        """Wrap ``payload`` in an envelope and append it; returns its offset."""
        if len(payload) > self._max_record:
            raise RecordTooLarge(f"record payload of {len(payload)} bytes exceeds max_record {self._max_record}")
        return self.append(encode(kind, payload))

    def flush(self) -> int:
        """fsync what has been appended; returns the new ``flushed_offset``."""
        with self._flush_lock:
            self._check_usable()
            target = self._end
            if target <= self._flushed:
                return self._flushed
            # Read target before the active segment: a roll in between has
            # already fsynced the segment holding target (under this lock).
            segment = self._active
            self._fsync(segment, target)
            self._flushed = target
            if self._verified.due(target):
                self._verified.save(segment.fd, segment.base, target)
            return target

    def drop_unflushed(self) -> int:
        """Cut what was appended past ``flushed_offset`` and take appends again; returns the bytes cut.

        For an owner that tells no one of an append before its flush (the ``sync``
        writer), after a failed fsync (a full disk) or a failed cut of a failed
        write: those bytes were acknowledged to nobody, and the kernel may have
        dropped their pages, so the log carries on from its last good flush
        rather than refusing every later append. Nobody may have read past
        ``flushed_offset`` (the scheduler's replay and the realtime index do not).
        """
        with self._append_lock, self._flush_lock:
            if self._closed:
                raise LogClosed(f"log {self._folder.path} is closed")
            segment = self._active
            keep = self._flushed - segment.base
            if keep < 0:  # cannot happen: a roll flushes the segment it leaves
                raise LogFailed(f"log {self._folder.path}: unflushed bytes before the active segment")
            cut = self._end - self._flushed
            try:
                os.ftruncate(segment.fd, keep)
            except OSError as error:
                self._failure = error
                raise LogIOError(
                    f"cannot cut segment {segment.path.name} back to offset {self._flushed}: {error}"
                ) from error
            segment.size = keep
            self._end = self._flushed
            self._failure = None
            if self._recent is not None:
                self._recent.clear()
            return cut

    def truncate(self, offset: int) -> int:
        """Cut the log back to ``offset`` (a record start, or the end) and fsync; returns the bytes cut.

        For a replica whose tail its new master never had (replication): the bytes
        were never acknowledged as replicated. Segments wholly past ``offset`` are
        deleted; the one holding it becomes the active segment. Nobody may be reading
        past ``offset`` (the scheduler's replay checkpoint must be at or below it).
        """
        with self._append_lock, self._flush_lock:
            if self._closed:
                raise LogClosed(f"log {self._folder.path} is closed")
            if offset >= self._end:
                if offset > self._end:
                    raise OffsetBeyondEnd(
                        f"offset {offset} is past the end of the log", offset, self.start_offset, self._end
                    )
                return 0
            bases, segments = self._index
            if offset < bases[0]:
                raise OffsetDeleted(
                    f"offset {offset} lies before the first retained offset {bases[0]}", offset, bases[0], self._end
                )
            if offset not in bases:
                self.read(offset)  # raises NotRecordStart unless a record starts there
            keep = bisect_right(bases, offset) - 1
            if keep and bases[keep] == offset:
                keep -= 1  # the previous segment stays active, ending at offset
            cut = self._end - offset
            held = segments[keep]
            try:
                self._verified.lower(held.fd, held.base, offset)
            except OSError as error:
                raise LogIOError(
                    f"cannot lower the verified end of log {self._folder.path} to {offset} "
                    f"before cutting it back: {error}"
                ) from error
            self._cut_files(segments, keep, offset)
            if self._recent is not None:
                self._recent.clear()
            with self._index_lock:
                self._index = (bases[: keep + 1], segments[: keep + 1])
            self._active = held
            self._end = offset
            self._flushed = offset  # the held segment was fsynced above, earlier ones at their roll
            _logger.warning("log %s: cut %d byte(s) back to offset %d", self._folder.path, cut, offset)
            return cut

    def _cut_files(self, segments: list[Segment], keep: int, offset: int) -> None:
        """Delete the segments after ``segments[keep]``, cut that one at ``offset`` and fsync (under both locks)."""
        held = segments[keep]
        try:
            for segment in segments[keep + 1 :]:
                segment.close()
                segment.path.unlink(missing_ok=True)
            os.ftruncate(held.fd, offset - held.base)
            os.fsync(held.fd)
            self._folder.fsync()
        except OSError as error:
            self._failure = error
            raise LogIOError(f"cannot cut log {self._folder.path} back to offset {offset}: {error}") from error
        held.size = offset - held.base

    def _write(self, segment: Segment, data: bytes | bytearray | memoryview, offset: int) -> None:
        try:
            pwrite_all(segment.fd, data, segment.size, path=segment.path)
        except OSError as error:
            try:
                os.ftruncate(segment.fd, segment.size)
            except OSError as cut_error:
                self._failure = cut_error
            raise LogIOError(
                f"append of {len(data)} bytes at offset {offset} to segment {segment.path.name} failed: {error}"
            ) from error

    def _fsync(self, segment: Segment, target: int) -> None:
        try:
            os.fsync(segment.fd)
        except OSError as error:
            # The kernel may have dropped the dirty pages: nothing after the last
            # good flush can be trusted, so refuse to go on.
            self._failure = error
            raise LogIOError(f"fsync of segment {segment.path.name} up to offset {target} failed: {error}") from error

    def roll(self) -> bool:
        """Start a new segment at the end now; False if the active segment is empty.

        The active segment is fsynced first, as a roll by size does. Segments are
        deleted whole and never the active one, so a writer whose load is too small
        to fill a segment rolls to let what it no longer needs be deleted. Blocking.
        """
        with self._append_lock:
            self._check_usable()
            if not self._active.size:
                return False
            self._roll()
            return True

    def _roll(self) -> Segment:
        """Start a new segment at the current end (called under the append lock)."""
        old = self._active
        with self._flush_lock:
            self._fsync(old, old.end)  # only the last segment may ever have a torn tail
            self._flushed = max(self._flushed, old.end)
        base = old.end
        path = self._folder.path / segment_name(base)
        try:
            fd = create_segment_file(path)
        except OSError as error:
            raise LogIOError(f"cannot create segment {path}: {error}") from error
        try:
            self._folder.fsync()
        except OSError as error:
            # Not ours yet: remove it, so the next roll (once space is back) can create it.
            os.close(fd)
            path.unlink(missing_ok=True)
            raise LogIOError(f"cannot create segment {path}: {error}") from error
        segment = Segment(base, path, fd, 0)
        with self._index_lock:
            bases, segments = self._index
            self._index = ([*bases, base], [*segments, segment])
        self._active = segment
        _logger.debug("log %s: new segment %s", self._folder.path, path.name)
        return segment

    def _check_record_sizes(self, data: bytes | bytearray | memoryview) -> None:
        # Only a batch big enough to hold an oversize record gets here. A record
        # over max_record would be cut off as corrupt by the next recovery.
        view = memoryview(data).cast("B")
        position = 0
        while position + HEADER_SIZE <= len(view):
            payload_size = HEADER.unpack_from(view, position)[0]
            if payload_size > self._max_record:
                raise RecordTooLarge(
                    f"record at batch byte {position} has a payload of {payload_size} bytes; "
                    f"max_record is {self._max_record}"
                )
            position += HEADER_SIZE + payload_size

    def _check_usable(self) -> None:
        if self._closed:
            raise LogClosed(f"log {self._folder.path} is closed")
        if self._failure is not None:
            raise LogFailed(
                f"log {self._folder.path} refuses appends after an earlier failure "
                f"({self._failure}); reopen it to recover"
            )

    # ----------------------------------------------------------------- deleting

    def delete_before(self, offset: int) -> int:
        """Delete the segments whose every record lies below ``offset``; returns how many.

        The active (last) segment is never deleted. Oldest go first, so a crash
        midway leaves a contiguous log.
        """
        if self._closed:
            raise LogClosed(f"log {self._folder.path} is closed")
        with self._index_lock:
            bases, segments = self._index
            count = 0
            while count < len(segments) - 1 and segments[count].end <= offset:
                count += 1
            if not count:
                return 0
            doomed = segments[:count]
            self._index = (bases[count:], segments[count:])
        for segment in doomed:
            segment.path.unlink()
        self._folder.fsync()
        _logger.info(
            "log %s: deleted %d segment(s) below offset %d (%s .. %s)",
            self._folder.path,
            count,
            doomed[-1].end,
            doomed[0].path.name,
            doomed[-1].path.name,
        )
        return count

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """Flush (unless an earlier failure forbids it) and release the folder."""
        if self._closed:
            return
        try:
            if self._failure is None:
                self.flush()
        finally:
            with self._append_lock, self._flush_lock, self._index_lock:
                self._closed = True
                if self._recent is not None:
                    self._recent.clear()
                for segment in self._index[1]:
                    segment.close()
                self._verified.close()
                self._folder.close()

    def __enter__(self) -> SegmentedLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<SegmentedLog {self._folder.path} [{self.start_offset}, {self._end}) flushed={self._flushed}>"
