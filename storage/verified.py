"""A segmented log's verified end: how far its records are known whole and durable.

Opening a log checks the CRC of every record it has not vouched for. Without a
record of what an earlier process already checked, that is the whole last
segment (a gigabyte: seconds). So the log keeps, in a small ``VERIFIED`` file
beside its segments, the offset below which every byte is a whole, fsynced
record: written only after the fsync that covers it, and lowered before a
``truncate`` cuts below it. The next open checks only the bytes after it.

The file holds two 32-byte slots written in turn (``pwrite`` + ``fdatasync``), so
a crash while one is written leaves the other: ``magic, version, sequence,
end, tail_crc, crc``. ``tail_crc`` is the CRC-32 of the up to ``TAIL_BYTES``
bytes just below ``end`` in its segment: the open reads them again, so a segment
that lost or changed bytes below the end is noticed. ``crc`` covers the slot.
A slot that does not check is ignored; with none left (or a tail that differs)
the log checks its whole last segment, as if it had no verified end, and says so.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from delaymq.storage.files import pwrite_all

VERIFIED_FILE = "VERIFIED"
TAIL_BYTES = 4096
_MAGIC = b"DMQV"
_VERSION = 1
_SLOT = struct.Struct(">4sB3xQQI")  # magic, version, sequence, end, tail_crc; then the crc of these 28 bytes
_CRC = struct.Struct(">I")
SLOT_SIZE = _SLOT.size + _CRC.size  # 32
_SLOTS = 2

# Logged under the log's own name: operators' logging settings and filters know it by that.
_logger = logging.getLogger("delaymq.storage.log")


class VerifiedEnd(NamedTuple):
    """One slot's content: ``end`` is vouched for if the ``tail_crc`` still matches."""

    sequence: int
    end: int
    tail_crc: int


def pack_slot(end: VerifiedEnd) -> bytes:
    body = _SLOT.pack(_MAGIC, _VERSION, end.sequence, end.end, end.tail_crc)
    return body + _CRC.pack(zlib.crc32(body))


def unpack_slot(data: bytes) -> VerifiedEnd | None:
    """The slot in ``data`` (``SLOT_SIZE`` bytes), or ``None`` if it is empty or does not check."""
    if len(data) != SLOT_SIZE:
        return None
    body = data[: _SLOT.size]
    magic, version, sequence, end, tail_crc = _SLOT.unpack(body)
    if magic != _MAGIC or version != _VERSION or _CRC.unpack_from(data, _SLOT.size)[0] != zlib.crc32(body):
        return None
    return VerifiedEnd(sequence, end, tail_crc)


def latest_slot(data: bytes) -> tuple[VerifiedEnd | None, int]:
    """The newest slot that checks in a file's bytes, and how many non-empty slots do not check."""
    best: VerifiedEnd | None = None
    damaged = 0
    for index in range(_SLOTS):
        raw = data[index * SLOT_SIZE : (index + 1) * SLOT_SIZE]
        slot = unpack_slot(raw)
        if slot is None:
            damaged += any(raw)  # an all-zero (never written) slot is not damage
        elif best is None or slot.sequence > best.sequence:
            best = slot
    return best, damaged


def tail_crc(fd: int, base: int, end: int) -> int:
    """CRC-32 of the up to ``TAIL_BYTES`` bytes below ``end`` in the segment file ``fd`` starting at ``base``."""
    start = max(base, end - TAIL_BYTES)
    data = os.pread(fd, end - start, start - base)
    if len(data) != end - start:
        return -1  # the segment is shorter: cannot match any stored CRC
    return zlib.crc32(data)


def read_verified(directory: Path) -> tuple[VerifiedEnd | None, int]:
    """The newest slot of ``directory``'s file that checks (``None`` without one) and how many slots are damaged."""
    try:
        data = (directory / VERIFIED_FILE).read_bytes()
    except FileNotFoundError:
        return None, 0
    return latest_slot(data[: _SLOTS * SLOT_SIZE])


class VerifiedEndFile:
    """The ``VERIFIED`` file of one log folder, created on the first save.

    ``save`` and ``reset`` block (one write, one ``fdatasync``); ``fsync_folder``
    makes the file's creation durable.
    """

    def __init__(self, directory: Path, latest: VerifiedEnd | None, *, fsync_folder: Callable[[], None]) -> None:
        self.path = directory / VERIFIED_FILE
        self.latest = latest
        self._fsync_folder = fsync_folder
        self._fd = -1

    def save(self, end: int, crc: int) -> None:
        """Write ``end`` into the slot not holding the latest one and make it durable."""
        sequence = self.latest.sequence + 1 if self.latest is not None else 1
        slot = VerifiedEnd(sequence, end, crc)
        self._write(pack_slot(slot), (sequence % _SLOTS) * SLOT_SIZE)
        self.latest = slot

    def reset(self, end: int, crc: int) -> None:
        """Write ``end`` into both slots (after damage was found: none of it is left)."""
        sequence = self.latest.sequence + 2 if self.latest is not None else 2
        first, second = VerifiedEnd(sequence - 1, end, crc), VerifiedEnd(sequence, end, crc)
        slots = {(s.sequence % _SLOTS): pack_slot(s) for s in (first, second)}
        self._write(slots[0] + slots[1], 0)
        self.latest = second

    def _write(self, data: bytes, position: int) -> None:
        if self._fd < 0:
            created = not self.path.exists()
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            if created:
                self._fsync_folder()
        pwrite_all(self._fd, data, position, path=self.path)
        os.fdatasync(self._fd)

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


class VerifiedEndKeeper:
    """A log's verified end as it moves: vouched for after an open, moved on by flushes, lowered before a cut.

    Flushes and cuts call it under the log's flush lock. A save that fails costs only a longer
    check at the next open, so it is logged (once while saves keep failing) and tried
    again ``checkpoint_bytes`` later, not raised; only ``lower`` raises.
    """

    def __init__(self, file: VerifiedEndFile, end: int, *, checkpoint_bytes: int, log_path: Path) -> None:
        self.file = file
        self.end = end  # the saved verified end
        self._tried = end  # where the last save was tried, failed or not
        self._failing = False
        self._checkpoint_bytes = checkpoint_bytes
        self._log_path = log_path

    def vouch_after_open(self, fd: int, base: int, end: int, *, distrusted: bool) -> None:
        """Save ``end``, what an open just checked in the segment ``fd`` at ``base``, if the stored
        end was distrusted (both slots replaced: what they held is worthless) or lags by ``checkpoint_bytes``."""
        try:
            if distrusted:
                self.file.reset(end, tail_crc(fd, base, end))
                self.end = end
            elif end - self.end >= self._checkpoint_bytes:
                self.file.save(end, tail_crc(fd, base, end))
                self.end = end
        except OSError as error:
            _logger.warning("log %s: cannot save its verified end %d: %s", self._log_path, end, error)
        self._tried = self.end

    def due(self, flushed: int) -> bool:
        """Whether a flush up to ``flushed`` should save it: ``checkpoint_bytes`` past the last save tried."""
        return flushed - max(self.end, self._tried) >= self._checkpoint_bytes

    def save(self, fd: int, base: int, end: int) -> None:
        """Save ``end`` (flushed, in the segment ``fd`` at ``base``) as the verified end."""
        self._tried = end
        try:
            self.file.save(end, tail_crc(fd, base, end))
        except OSError as error:
            if not self._failing:
                self._failing = True
                _logger.warning(
                    "log %s: cannot save its verified end %d (the next open checks more of the last segment): %s",
                    self._log_path,
                    end,
                    error,
                )
            return
        if self._failing:
            self._failing = False
            _logger.info("log %s: verified end saved again (%d)", self._log_path, end)
        self.end = end

    def lower(self, fd: int, base: int, offset: int) -> None:
        """Bring the verified end down to ``offset`` (in the segment ``fd`` at ``base``) if it is above.

        Before the log is cut there: bytes appended at those offsets later are not
        the ones it vouched for. ``OSError`` if it cannot be saved: the cut must not go ahead.
        """
        if self.end <= offset:
            return
        self.file.save(offset, tail_crc(fd, base, offset))
        self.end = self._tried = offset

    def close(self) -> None:
        self.file.close()


__all__ = [
    "SLOT_SIZE",
    "TAIL_BYTES",
    "VERIFIED_FILE",
    "VerifiedEnd",
    "VerifiedEndFile",
    "VerifiedEndKeeper",
    "latest_slot",
    "read_verified",
    "tail_crc",
]
