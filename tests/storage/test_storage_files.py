"""``pwrite_all``: a short write is finished, a write that makes no progress is named ENOSPC."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from delaymq.storage.files import pwrite_all


def test_short_writes_are_finished_at_the_right_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "segment"
    path.write_bytes(b"." * 4)
    real = os.pwrite
    calls: list[int] = []

    def three_bytes_at_a_time(fd: int, data: memoryview, offset: int) -> int:
        calls.append(offset)
        return real(fd, data[:3], offset)

    monkeypatch.setattr(os, "pwrite", three_bytes_at_a_time)
    fd = os.open(path, os.O_WRONLY)
    try:
        pwrite_all(fd, b"abcdefgh", 2, path=path)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"..abcdefgh" and calls == [2, 5, 8]


def test_a_write_that_makes_no_progress_is_a_full_disk_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: 0)
    with pytest.raises(OSError) as error:
        pwrite_all(3, b"abc", 0, path=tmp_path / "hour.log")
    assert error.value.errno == errno.ENOSPC and "hour.log" in str(error.value)
