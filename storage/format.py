"""On-disk format parameters kept beside the data (docs/architecture.md, "Storage").

Each data folder holds a ``FORMAT`` file, a small JSON object such as
``{"format": "segmented-log", "version": 1, "segment_size": 1073741824}``. The first
open writes it (temp file, fsync, rename, directory fsync, so a crash leaves the
old file or the new one, never half of one); later opens compare it with what
they were asked for and refuse data written with other parameters, naming each
difference, instead of misreading it. Tools outside a server (the backlog job)
read it with ``read_format`` to learn how to read the folder.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from delaymq.storage.errors import FormatMismatch, FormatUnreadable
from delaymq.storage.folder import fsync_directory

FORMAT_FILE = "FORMAT"

FormatValue = str | int | bool
FormatParams = Mapping[str, FormatValue]


def read_format(directory: str | os.PathLike[str]) -> dict[str, FormatValue] | None:
    """The parameters stored in ``directory``, or ``None`` if it has no format file."""
    path = Path(directory) / FORMAT_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        stored = json.loads(text)
    except ValueError as error:
        raise FormatUnreadable(f"{path} is not valid JSON: {error}") from error
    if not isinstance(stored, dict):
        raise FormatUnreadable(f"{path} must hold a JSON object, found {type(stored).__name__}")
    return stored


def write_format(directory: str | os.PathLike[str], params: FormatParams) -> None:
    """Store ``params`` atomically: a crash leaves the old file or the new one."""
    write_json_atomically(Path(directory) / FORMAT_FILE, dict(params))


def write_json_atomically(final: Path, value: object) -> None:
    """Write ``value`` as JSON to ``final``: temp file, fsync, rename, directory fsync."""
    folder = final.parent
    temp = folder / (final.name + ".tmp")
    data = (json.dumps(value, indent=2, sort_keys=True) + "\n").encode("utf-8")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temp, final)
    fsync_directory(folder)


def ensure_format(directory: str | os.PathLike[str], params: FormatParams, *, has_data: bool) -> dict[str, FormatValue]:
    """Write ``params`` on first use, or check them against the stored ones.

    ``has_data`` says whether the folder already holds data: data without a
    format file is refused rather than assumed to match.
    Raises ``FormatMismatch`` naming every parameter that differs.
    """
    folder = Path(directory)
    wanted = _normalise(params)
    stored = read_format(folder)
    if stored is None:
        if has_data:
            raise FormatUnreadable(f"{folder} holds data but no {FORMAT_FILE} file; refusing to guess its format")
        write_format(folder, wanted)
        return wanted
    differences = [
        (name, stored.get(name), wanted.get(name))
        for name in sorted(stored.keys() | wanted.keys())
        if stored.get(name) != wanted.get(name)
    ]
    if differences:
        raise FormatMismatch(folder, differences)
    return stored


def _normalise(params: FormatParams) -> dict[str, FormatValue]:
    # Compare what JSON would give back, so a value round-trips to itself.
    normal: dict[str, FormatValue] = json.loads(json.dumps(dict(params)))
    return normal
