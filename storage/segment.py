"""A segmented log's segment files: their names, how they are found and opened.

A segment file is named by the global offset of its first byte, in
``SEGMENT_NAME_DIGITS`` zero-padded digits, so a directory listing sorted by name
is the log in order and any offset maps to its file by the name alone.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

SEGMENT_NAME_DIGITS = 20
_SEGMENT_NAME = re.compile(r"^[0-9]{%d}$" % SEGMENT_NAME_DIGITS)


def segment_name(base: int) -> str:
    """The file name of the segment whose first byte is at offset ``base``."""
    return f"{base:0{SEGMENT_NAME_DIGITS}d}"


def segment_bases(directory: str | os.PathLike[str]) -> list[int]:
    """The first offsets of the segment files in ``directory``, ascending (other files ignored)."""
    return sorted(int(name) for name in os.listdir(directory) if _SEGMENT_NAME.match(name))


def create_segment_file(path: Path) -> int:
    """Create the segment file ``path`` (never an existing one: ``FileExistsError``); returns its fd.

    The caller fsyncs the folder before the segment counts as part of the log.
    """
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)


class Segment:
    """One segment file: its first offset, its length and an open descriptor.

    A deleted segment is dropped from the index but its descriptor stays open
    until the last reader holding it lets go (``__del__``), so a concurrent read
    of a segment being deleted reads the unlinked file, never a reused fd.
    """

    __slots__ = ("base", "size", "fd", "path")

    def __init__(self, base: int, path: Path, fd: int, size: int) -> None:
        self.base = base
        self.path = path
        self.fd = fd
        self.size = size

    @classmethod
    def open_existing(cls, directory: Path, base: int) -> Segment:
        """Open the segment file at ``base`` in ``directory`` for reading and writing, as long as it is now."""
        path = directory / segment_name(base)
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        return cls(base, path, fd, os.fstat(fd).st_size)

    @property
    def end(self) -> int:
        return self.base + self.size

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing useful to do
            pass
