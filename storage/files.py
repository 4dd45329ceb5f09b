"""Positional writes that finish: the one loop every log's writer uses.

``os.pwrite`` may write less than it was given (a signal, a filling disk); every
caller wants all of it at that position or an ``OSError``. A write that makes no
progress is a full disk in all but name, so it raises ENOSPC naming the file.
"""

from __future__ import annotations

import errno
import os


def pwrite_all(fd: int, data: bytes | bytearray | memoryview, position: int, *, path: object = None) -> None:
    """Write all of ``data`` at ``position`` of ``fd`` (to the page cache; the caller fsyncs)."""
    with memoryview(data).cast("B") as view:
        while view:
            written = os.pwrite(fd, view, position)
            if written <= 0:
                raise OSError(errno.ENOSPC, f"write to {path or f'fd {fd}'} made no progress")
            view = view[written:]
            position += written


__all__ = ["pwrite_all"]
