"""Files by location: a local path or ``file://`` URI, or any remote file system pyarrow knows.

The driver lists folders with ``list_folder``; tasks read byte ranges with
``open_file``. Local files are read with ``pread`` (never mapped: a server may cut a
file it owns while we read it, and a mapped page past the end would kill the worker).
Other locations (``hdfs://``, ``s3a://``, ``s3://``, ``gs://``, ``abfs://``) go
through ``pyarrow.fs``, which must be installed where the job runs (the ``spark``
extra); ``s3a://`` and ``s3n://`` are Hadoop's names for ``s3://``. ``arrow+file://``
reads local files through pyarrow too: the remote path, checked on local data.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

#: Hadoop's scheme names that pyarrow spells otherwise.
_SCHEME_ALIASES = {"s3a": "s3", "s3n": "s3", "arrow+file": "file"}


class FileReader(Protocol):
    size: int

    def read(self, offset: int, length: int) -> bytes: ...

    def close(self) -> None: ...


def is_local(location: str) -> bool:
    """A plain path or ``file://`` URI (read with the operating system)."""
    scheme = urlparse(location).scheme
    return scheme in ("", "file") or (len(scheme) == 1 and os.name == "nt")


def local_path(location: str) -> Path:
    return Path(urlparse(location).path) if location.startswith("file://") else Path(location)


def join(location: str, *names: str) -> str:
    """``location`` with ``names`` appended, keeping its scheme."""
    return "/".join([location.rstrip("/"), *names])


def normalise(location: str) -> str:
    """A location as the job keeps it: local paths absolute, URIs as given (no trailing slash)."""
    if is_local(location):
        return str(local_path(location).resolve())
    return location.rstrip("/")


@dataclass(frozen=True, slots=True)
class Listing:
    """The files of one folder (name -> size); ``exists`` is False for a missing folder."""

    exists: bool
    sizes: dict[str, int]


def list_folder(location: str) -> Listing:
    """Names and sizes of the regular files directly in ``location``."""
    if is_local(location):
        path = local_path(location)
        if not path.is_dir():
            return Listing(False, {})
        sizes = {}
        with os.scandir(path) as entries:
            for entry in entries:
                try:
                    if entry.is_file(follow_symlinks=False):
                        sizes[entry.name] = entry.stat(follow_symlinks=False).st_size
                except FileNotFoundError:  # removed while we listed
                    continue
        return Listing(True, sizes)
    fs, arrow_path = _arrow(location)
    from pyarrow import fs as pafs

    info = fs.get_file_info(arrow_path)
    if info.type != pafs.FileType.Directory:
        return Listing(False, {})
    selector = pafs.FileSelector(arrow_path, recursive=False, allow_not_found=True)
    return Listing(
        True,
        {item.base_name: item.size for item in fs.get_file_info(selector) if item.type == pafs.FileType.File},
    )


class _LocalFile:
    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self.size = os.fstat(self._fd).st_size

    def read(self, offset: int, length: int) -> bytes:
        """Up to ``length`` bytes at ``offset`` (fewer at the end of the file)."""
        parts = []
        while length > 0:
            chunk = os.pread(self._fd, length, offset)
            if not chunk:
                break
            parts.append(chunk)
            offset += len(chunk)
            length -= len(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class _ArrowFile:
    def __init__(self, handle: Any) -> None:
        self._handle = handle
        self.size = handle.size()

    def read(self, offset: int, length: int) -> bytes:
        length = max(0, min(length, self.size - offset))
        return self._handle.read_at(length, offset) if length else b""

    def close(self) -> None:
        self._handle.close()


def open_file(location: str) -> FileReader:
    """A reader of one file; ``FileNotFoundError`` when it is not there."""
    if is_local(location):
        return _LocalFile(local_path(location))
    fs, path = _arrow(location)
    try:
        return _ArrowFile(fs.open_input_file(path))
    except (FileNotFoundError, OSError) as error:
        if "not found" in str(error).lower() or "no such file" in str(error).lower():
            raise FileNotFoundError(location) from error
        raise


def read_whole(location: str, *, limit: int | None = None) -> bytes:
    """A file's bytes (the first ``limit`` of them when given)."""
    reader = open_file(location)
    try:
        return reader.read(0, reader.size if limit is None else min(limit, reader.size))
    finally:
        reader.close()


def write_text(location: str, text: str) -> None:
    """Write a small text file (the HTML report), replacing it."""
    if is_local(location):
        path = local_path(location)
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(path.name + ".tmp")
        temp.write_text(text, encoding="utf-8")
        os.replace(temp, path)
        return
    fs, path_text = _arrow(location)
    with fs.open_output_stream(path_text) as stream:
        stream.write(text.encode("utf-8"))


def _arrow(location: str) -> tuple[Any, str]:
    try:
        from pyarrow import fs as pafs
    except ImportError as error:  # pragma: no cover - the spark extra installs it
        raise RuntimeError(
            f"{location}: reading a non-local path needs pyarrow (pip install 'delaymq[spark]')"
        ) from error
    parsed = urlparse(location)
    scheme = _SCHEME_ALIASES.get(parsed.scheme, parsed.scheme)
    uri = location.replace(parsed.scheme + "://", scheme + "://", 1)
    fs, path = pafs.FileSystem.from_uri(uri)
    return fs, path


__all__ = [
    "FileReader",
    "Listing",
    "is_local",
    "join",
    "list_folder",
    "local_path",
    "normalise",
    "open_file",
    "read_whole",
    "write_text",
]
