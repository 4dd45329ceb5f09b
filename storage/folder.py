"""A data folder held open: its directory fd, an exclusive lock, and directory fsync.

Creating or renaming a file is durable only once the directory itself is fsynced,
and two processes writing one log would interleave records, so every log and
store holds its folder through one of these.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from delaymq.storage.errors import DirectoryLocked


class DataFolder:
    """An open, exclusively locked data folder (created if missing)."""

    def __init__(self, directory: str | os.PathLike[str], *, what: str) -> None:
        self.path = Path(directory)
        created = not self.path.exists()
        self.path.mkdir(parents=True, exist_ok=True)
        if created:
            fsync_directory(self.path.parent)
        self._fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            # flock locks belong to the open file description, so a second open of
            # the same folder in this process is refused too, not only another process.
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise DirectoryLocked(
                f"cannot open {what} in {self.path}: the folder is already open "
                "(by this process or another); one writer per folder"
            ) from None

    def fsync(self) -> None:
        """Make file creations, renames and deletions in the folder durable."""
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # also releases the lock
            self._fd = -1


def fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
