"""What opening a segmented log does to its files: check the tail no one vouched for, cut what is torn.

Only the last segment can have a torn tail (a segment is fsynced before the next
one is created). The open checks its records from the stored verified end on
(``delaymq.storage.verified``), or from its start when that end is missing or no
longer matches the bytes below it, and cuts the segment at the first record that
does not check. An empty last segment after another is removed, so the one before
it is checked in turn. Damage anywhere else (a missing or short older segment) is
not repaired: ``CorruptLog``. ``restart_at`` empties a closed log and has it go on at a
later offset (its owner needs none of its records, and lost some).
"""

from __future__ import annotations

import logging
import os
from typing import NamedTuple

from delaymq.protocol.envelope import CorruptRecord, EnvelopeError, TruncatedRecord, iter_spans
from delaymq.storage.errors import CorruptLog
from delaymq.storage.folder import DataFolder
from delaymq.storage.segment import Segment, create_segment_file, segment_bases, segment_name
from delaymq.storage.verified import VERIFIED_FILE, VerifiedEnd, tail_crc

_SCAN_CHUNK = 8 << 20  # recovery reads the last segment this much at a time

# Logged under the log's own name: operators' logging settings and filters know it by that.
_logger = logging.getLogger("delaymq.storage.log")


class Recovery(NamedTuple):
    """What an open found: the verified end it started from, the bytes it checked and cut."""

    verified_end: int  # the stored verified end the open relied on (0: none usable)
    checked_bytes: int  # bytes whose records the open read and checked
    cut_bytes: int  # torn or damaged bytes cut from the end
    distrusted: str | None = None  # why a stored verified end was ignored, if it was


def recover_segments(
    folder: DataFolder, bases: list[int], max_record: int, stored: VerifiedEnd | None, damaged: int
) -> tuple[list[Segment], Recovery]:
    """Open the segment files, cut a torn tail after the verified end, drop empty trailing segments."""
    distrusted = f"{damaged} slot(s) of its verified-end file do not check" if damaged and stored is None else None
    if not bases:
        path = folder.path / segment_name(0)
        fd = create_segment_file(path)
        folder.fsync()
        return [Segment(0, path, fd, 0)], Recovery(0, 0, 0, distrusted)
    check = _TailCheck(folder, max_record, stored, distrusted)
    segments: list[Segment] = []
    try:
        for base in bases:
            segments.append(Segment.open_existing(folder.path, base))
        while True:
            last = segments[-1]
            check.check(last)
            if last.size or len(segments) == 1:
                break
            # An empty segment after another one holds nothing: the previous one
            # becomes active again (offsets do not move, its end is this base).
            _logger.info("log %s: removing empty last segment %s", folder.path, last.path.name)
            last.close()
            last.path.unlink()
            segments.pop()
        folder.fsync()
        _check_contiguous(folder, segments)
        os.fsync(segments[-1].fd)  # what a previous process wrote is durable from here on
    except BaseException:
        for segment in segments:
            segment.close()
        raise
    if check.checked:
        _logger.info(
            "log %s: checked %d byte(s) of segment %s after its verified end %d",
            folder.path,
            check.checked,
            segments[-1].path.name,
            check.vouched,
        )
    return segments, Recovery(check.vouched, check.checked, check.cut, check.distrusted)


class _TailCheck:
    """One open's check of its last segment(s): the verified end it trusts, the bytes it checked and cut."""

    def __init__(self, folder: DataFolder, max_record: int, stored: VerifiedEnd | None, distrusted: str | None) -> None:
        self.folder = folder
        self.max_record = max_record
        self.stored = stored
        self.vouched = stored.end if stored is not None else 0
        self.distrusted = distrusted
        self.checked = 0
        self.cut = 0
        self._warned = False

    def check(self, last: Segment) -> None:
        """Check ``last``'s records after what the verified end vouches for; cut it at the first bad one."""
        start = self._vouched_bytes(last)
        if self.distrusted is not None and not self._warned and last.size:
            self._warned = True
            _logger.warning(
                "log %s: %s; checking all %d byte(s) of segment %s",
                self.folder.path,
                self.distrusted,
                last.size,
                last.path.name,
            )
        valid, error = valid_end(last.fd, last.size, self.max_record, start)
        self.checked += last.size - start
        if error is not None:
            _logger.warning(
                "log %s: segment %s: cut %d byte(s) from offset %d: %s; every record before it is intact",
                self.folder.path,
                last.path.name,
                last.size - valid,
                last.base + valid,
                error.reason,
            )
            os.ftruncate(last.fd, valid)
            self.cut += last.size - valid
            last.size = valid

    def _vouched_bytes(self, last: Segment) -> int:
        """How many bytes at the start of ``last`` the verified end vouches for; 0 once it is distrusted."""
        stored = self.stored
        if stored is None or self.vouched <= last.base:
            return 0
        if self.vouched > last.end:
            problem = f"it lies past the end of segment {last.path.name} ({last.end})"
        elif tail_crc(last.fd, last.base, self.vouched) != stored.tail_crc:
            problem = f"the bytes below it in segment {last.path.name} are not the ones it vouched for"
        else:
            return self.vouched - last.base
        self.distrusted = f"verified end {self.vouched}: {problem}"
        self.vouched = 0
        return 0


def restart_at(directory: str | os.PathLike[str], offset: int) -> int:
    """Empty the closed segmented log in ``directory`` and have it go on at ``offset`` (at or
    past its end); returns the bytes its segments held.

    For an owner that needs none of its records any more and must never append where records
    it lost were (the scheduler's message log, found ending below what was filed from it): the
    next append goes to ``offset``, and a read below it is ``OffsetDeleted``. The verified-end
    file goes first, then the segments oldest first, each deletion made durable, and the empty
    segment at ``offset`` is created last: a crash midway leaves whole segments that follow one
    another (or none: the log then opens empty at 0), which the owner restarts again."""
    folder = DataFolder(directory, what="segmented log")
    try:
        bases = segment_bases(folder.path)
        sizes = [os.stat(folder.path / segment_name(base)).st_size for base in bases]
        end = bases[-1] + sizes[-1] if bases else 0
        if end > offset:
            raise ValueError(f"log {folder.path} ends at {end}, past {offset}: restarting there would drop records")
        (folder.path / VERIFIED_FILE).unlink(missing_ok=True)
        folder.fsync()
        for base in bases:
            (folder.path / segment_name(base)).unlink()
            folder.fsync()
        os.close(create_segment_file(folder.path / segment_name(offset)))
        folder.fsync()
    finally:
        folder.close()
    if bases:
        _logger.warning(
            "log %s: dropped its %d segment(s) (%d byte(s), offsets %d..%d); it goes on at offset %d",
            directory, len(bases), sum(sizes), bases[0], end, offset,
        )  # fmt: skip
    return sum(sizes)


def _check_contiguous(folder: DataFolder, segments: list[Segment]) -> None:
    """``CorruptLog`` unless each segment starts where the one before it ends."""
    for before, after in zip(segments, segments[1:]):
        if before.end != after.base:
            raise CorruptLog(
                f"log {folder.path}: segment {before.path.name} ends at offset {before.end} "
                f"but the next segment starts at {after.base}; a segment is missing, cut "
                "short or overlapping, and recovery only repairs the last segment"
            )


def valid_end(fd: int, size: int, max_record: int, start: int = 0) -> tuple[int, EnvelopeError | None]:
    """How far a segment file holds intact records from ``start`` (a record start), and why it stops there."""
    position = start
    chunk = _SCAN_CHUNK
    while position < size:
        buf = os.pread(fd, min(chunk, size - position), position)
        if not buf:
            break
        good = 0
        try:
            for span in iter_spans(buf, max_payload=max_record):
                good = span.end
        except TruncatedRecord as error:
            if position + len(buf) >= size:
                return position + good, error
            # The chunk, not the file, ended: go on from the cut record, with a
            # bigger chunk if a single record did not fit.
            chunk = chunk * 2 if good == 0 else _SCAN_CHUNK
        except CorruptRecord as error:
            return position + good, error
        else:
            good = len(buf)
        position += good
    return position, None
