"""Full disks for tests, real and injected, in the spirit of ``trio.testing``.

- ``FullDisk``: while its block runs, writes to files under the paths given to
  ``fill`` fail with ENOSPC, as on a full file system: ``os.pwrite``,
  ``os.write`` and (if asked) ``os.fsync``, and commits of lmdb environments
  opened in the block. A filling disk takes part of a write first
  (``partial``). ``free`` gives the space back. In-process and instant, so each
  step of a write path can be failed on its own.
- ``small_tmpfs``: a real tmpfs of a few megabytes mounted on a folder (root
  only), and ``fill_up`` to fill it with a file that is deleted to free it.

This module is a public helper for tests; the servers never use it.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any

import lmdb

_MOUNT = shutil.which("mount") or "/bin/mount"
_UMOUNT = shutil.which("umount") or "/bin/umount"


def _enospc() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class FullDisk:
    """Fails writes under ``fill``'s paths with ENOSPC while its ``with`` block runs."""

    def __init__(self) -> None:
        self._paths: tuple[str, ...] = ()
        self._partial = False
        self._fsync = False
        self.refused = 0  # writes, fsyncs and commits refused
        self._saved: list[tuple[Any, str, Any]] = []

    def fill(self, *paths: str | os.PathLike[str], partial: bool = False, fsync: bool = False) -> None:
        """From now on writes to files under ``paths`` fail (``partial``: the first takes half its bytes first;
        ``fsync``: fsyncs fail too, as on file systems that find out only then)."""
        self._paths = tuple(os.fspath(path) for path in paths)
        self._partial = partial
        self._fsync = fsync

    def free(self) -> None:
        self._paths = ()

    def full(self, path: str) -> bool:
        return bool(self._paths) and path.startswith(self._paths)

    def _full_fd(self, fd: int) -> bool:
        if not self._paths:
            return False
        try:
            return self.full(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            return False

    # -------------------------------------------------------------- patching

    def __enter__(self) -> FullDisk:
        real_pwrite, real_write, real_fsync, real_open = os.pwrite, os.write, os.fsync, lmdb.open

        def pwrite(fd: int, data: Any, offset: int) -> int:
            if self._full_fd(fd):
                view = memoryview(data).cast("B")
                if self._partial and len(view) > 1:  # the last free blocks take part of it
                    self._partial = False
                    return real_pwrite(fd, view[: len(view) // 2], offset)
                self.refused += 1
                raise _enospc()
            return real_pwrite(fd, data, offset)

        def write(fd: int, data: Any) -> int:
            if self._full_fd(fd):
                self.refused += 1
                raise _enospc()
            return real_write(fd, data)

        def fsync(fd: int) -> None:
            if self._fsync and self._full_fd(fd):
                self.refused += 1
                raise _enospc()
            real_fsync(fd)

        def open_env(path: str, **options: Any) -> Any:
            return _Environment(real_open(path, **options), self)

        for target, name, replacement in (
            (os, "pwrite", pwrite),
            (os, "write", write),
            (os, "fsync", fsync),
            (lmdb, "open", open_env),
        ):
            self._saved.append((target, name, getattr(target, name)))
            setattr(target, name, replacement)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        while self._saved:
            target, name, original = self._saved.pop()
            setattr(target, name, original)


class _Environment:
    """An lmdb environment whose write transactions fail to commit while its folder is full."""

    def __init__(self, env: Any, disk: FullDisk) -> None:
        self._env = env
        self._disk = disk

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)

    def begin(self, **options: Any) -> Any:
        txn = self._env.begin(**options)
        if options.get("write") and self._disk.full(self._env.path()):
            return _FailingTransaction(txn, self._disk)
        return txn


class _FailingTransaction:
    """Takes puts and deletes, then fails to commit as lmdb does on a full disk (and writes nothing)."""

    def __init__(self, txn: Any, disk: FullDisk) -> None:
        self._txn = txn
        self._disk = disk

    def __getattr__(self, name: str) -> Any:
        return getattr(self._txn, name)

    def __enter__(self) -> _FailingTransaction:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        self._txn.abort()
        if exc_type is None:
            self._disk.refused += 1
            raise lmdb.DiskError("mdb_txn_commit: No space left on device")


# ------------------------------------------------------------------ a real one


class TmpfsUnavailable(Exception):
    """No tmpfs could be mounted here (not root, or no mount permission in this container)."""


@contextmanager
def small_tmpfs(directory: str | os.PathLike[str], *, size: str = "8m") -> Iterator[Path]:
    """A tmpfs of ``size`` mounted on ``directory`` for the block, unmounted after (root only)."""
    path = Path(directory)
    if os.geteuid() != 0:
        raise TmpfsUnavailable("mounting a tmpfs needs root")
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        [_MOUNT, "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True
    )
    if mounted.returncode:
        raise TmpfsUnavailable(f"mount -t tmpfs on {path} failed: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        if subprocess.run([_UMOUNT, str(path)], capture_output=True).returncode:
            subprocess.run([_UMOUNT, "-l", str(path)], capture_output=True)  # still busy: detach it


def fill_up(filler: str | os.PathLike[str], *, chunk: int = 64 << 10) -> int:
    """Write ``filler`` until its file system is full; returns its size (delete it to free the space)."""
    block = b"\0" * chunk
    size = 0
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
    try:
        while chunk:
            try:
                size += os.write(fd, block[:chunk])
            except OSError as error:
                if error.errno != errno.ENOSPC:
                    raise
                chunk //= 2  # the last blocks: smaller writes until not one byte fits
    finally:
        os.close(fd)
    return size


def free_space(path: str | os.PathLike[str]) -> int:
    """Bytes an unprivileged writer may still put on ``path``'s file system."""
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


__all__ = ["FullDisk", "TmpfsUnavailable", "fill_up", "free_space", "small_tmpfs"]
