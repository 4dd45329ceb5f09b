"""The verified end: an open checks only the records after it, and trusts nothing that does not check.

Damage is written into the files with plain file I/O, and one write is really cut
short: a child process is killed by SIGXFSZ in the middle of an append.
"""

from __future__ import annotations

import logging
import os
import signal
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from delaymq.protocol.envelope import HEADER_SIZE, RecordKind, encode
from delaymq.storage.errors import NotRecordStart
from delaymq.storage.log import SegmentedLog
from delaymq.storage.verified import SLOT_SIZE, TAIL_BYTES, VERIFIED_FILE, read_verified

SEGMENT_SIZE = 1 << 20  # one segment: the one an open would otherwise check whole
CHECKPOINT = 4096  # the verified end moves every 4 KiB flushed
RECORD = HEADER_SIZE + 88


def payload(i: int) -> bytes:
    return f"payload-{i:05d}-".encode().ljust(88, b"~")


def open_log(directory: Path) -> SegmentedLog:
    return SegmentedLog.open(directory, segment_size=SEGMENT_SIZE, checkpoint_bytes=CHECKPOINT)


def build_log(directory: Path, count: int) -> tuple[list[int], int]:
    """``count`` records, each flushed (as the sync writer does), then closed; returns their offsets and
    the verified end."""
    with open_log(directory) as log:
        offsets = []
        for i in range(count):
            offsets.append(log.append_record(RecordKind.MESSAGE, payload(i)))
            log.flush()
        verified = log.verified_end
    assert 0 < verified < offsets[-1]  # records after the verified end: the tail an open checks
    return offsets, verified


def segment(directory: Path) -> Path:
    (path,) = [p for p in directory.iterdir() if p.name.isdigit()]
    return path


def flip_byte_at(path: Path, position: int) -> None:
    with open(path, "r+b") as file:
        file.seek(position)
        byte = file.read(1)
        file.seek(position)
        file.write(bytes([byte[0] ^ 0x5A]))


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_an_open_checks_only_the_records_after_the_verified_end(tmp_path: Path) -> None:
    offsets, verified = build_log(tmp_path, 200)
    end = offsets[-1] + RECORD
    with open_log(tmp_path) as log:
        assert log.recovery.verified_end == verified
        assert log.recovery.checked_bytes == end - verified < CHECKPOINT
        assert log.recovery.cut_bytes == 0
        assert [r.payload for r in log.iter_from(0)] == [payload(i) for i in range(200)]
    # Without the file (a folder from before it existed) the whole segment is checked, as it always was.
    (tmp_path / VERIFIED_FILE).unlink()
    with open_log(tmp_path) as log:
        assert log.recovery.checked_bytes == end
        assert log.end_offset == end


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        ("half-written record", "truncated record payload"),
        ("flipped byte in the last record", "bad record CRC"),
    ],
)
def test_damage_after_the_verified_end_is_cut_exactly_as_without_one(
    tmp_path: Path, damage: str, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    offsets, verified = build_log(tmp_path, 200)
    path = segment(tmp_path)
    if damage == "half-written record":
        with open(path, "ab") as file:
            file.write(encode(RecordKind.MESSAGE, payload(999))[:40])
        intact = 200
    else:
        flip_byte_at(path, offsets[-1] + RECORD - 10)
        intact = 199
    cut_at = offsets[intact] if intact < len(offsets) else offsets[-1] + RECORD
    with caplog.at_level(logging.INFO, logger="delaymq.storage.log"):
        log = open_log(tmp_path)
    with log:
        assert log.recovery.verified_end == verified
        assert log.recovery.checked_bytes == path.stat().st_size + log.recovery.cut_bytes - verified
        assert log.end_offset == cut_at
        assert [r.payload for r in log.iter_from(0)] == [payload(i) for i in range(intact)]
        (warning,) = warnings_of(caplog)
        assert f"from offset {cut_at}" in warning and reason in warning
        assert log.append_record(RecordKind.MESSAGE, b"after recovery") == cut_at


def test_a_damaged_byte_well_before_the_verified_end_is_not_read_at_open_and_costs_its_record_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    offsets, verified = build_log(tmp_path, 200)
    victim = 10
    assert offsets[victim] + RECORD < verified - TAIL_BYTES
    flip_byte_at(segment(tmp_path), offsets[victim] + 50)
    with caplog.at_level(logging.WARNING, logger="delaymq.storage.log"):
        log = open_log(tmp_path)
    with log:
        assert warnings_of(caplog) == []
        assert log.recovery.checked_bytes == log.end_offset - verified
        # Every acknowledged record after it is kept (a check from the start would have cut them all) ...
        assert log.end_offset == offsets[-1] + RECORD
        assert [log.read(offsets[i]).payload for i in range(victim + 1, 200)] == [
            payload(i) for i in range(victim + 1, 200)
        ]
        # ... and the damaged one is never handed out as if it were intact.
        with pytest.raises(NotRecordStart, match="bad record CRC"):
            log.read(offsets[victim])


def test_a_damaged_byte_just_below_the_verified_end_makes_the_open_check_the_whole_segment(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    offsets, verified = build_log(tmp_path, 200)
    victim = max(i for i, offset in enumerate(offsets) if offset + RECORD <= verified)
    flip_byte_at(segment(tmp_path), offsets[victim] + 50)
    with caplog.at_level(logging.WARNING, logger="delaymq.storage.log"):
        log = open_log(tmp_path)
    with log:
        distrust, cut = warnings_of(caplog)
        assert f"verified end {verified}" in distrust and "not the ones it vouched for" in distrust
        assert f"from offset {offsets[victim]}" in cut
        assert log.recovery.checked_bytes == offsets[-1] + RECORD
        assert log.end_offset == offsets[victim]
        assert [r.payload for r in log.iter_from(0)] == [payload(i) for i in range(victim)]


def _slot_end_offset(slot: int) -> int:
    return slot * SLOT_SIZE + 16  # magic 4, version 1, pad 3, sequence 8: then the end


@pytest.mark.parametrize("damage", ["garbage", "a bigger end without its crc", "an end past the segment"])
def test_a_damaged_verified_file_never_makes_the_open_trust_unchecked_bytes(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    offsets, verified = build_log(tmp_path, 200)
    path = segment(tmp_path)
    torn = encode(RecordKind.MESSAGE, payload(999))[:50]
    with open(path, "ab") as file:  # a torn tail the open must still cut
        file.write(torn)
    file_path = tmp_path / VERIFIED_FILE
    data = bytearray(file_path.read_bytes())
    claim = path.stat().st_size + (0 if damage != "an end past the segment" else 4096)
    if damage == "garbage":
        data[:] = os.urandom(len(data)) + b"\x01"
    else:
        for slot in (0, 1):  # both slots: neither may vouch for the torn bytes
            start = _slot_end_offset(slot)
            data[start : start + 8] = claim.to_bytes(8, "big")
            if damage == "an end past the segment":  # a slot that checks, for a segment that lost bytes
                body = bytes(data[slot * SLOT_SIZE : slot * SLOT_SIZE + 28])
                data[slot * SLOT_SIZE + 28 : slot * SLOT_SIZE + 32] = struct.pack(">I", zlib.crc32(body))
    file_path.write_bytes(bytes(data))

    with caplog.at_level(logging.WARNING, logger="delaymq.storage.log"):
        log = open_log(tmp_path)
    with log:
        distrust, cut = warnings_of(caplog)
        assert "checking all" in distrust
        assert f"from offset {offsets[-1] + RECORD}" in cut
        assert log.recovery.checked_bytes == path.stat().st_size + len(torn)
        assert log.end_offset == offsets[-1] + RECORD
        assert [r.payload for r in log.iter_from(0)] == [payload(i) for i in range(200)]
    # The damage was replaced by what that open checked: the next open trusts it, quietly.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="delaymq.storage.log"), open_log(tmp_path) as log:
        assert warnings_of(caplog) == []
        assert log.recovery.checked_bytes == 0
        assert read_verified(tmp_path)[0] is not None


def test_a_torn_slot_leaves_the_other_one(tmp_path: Path) -> None:
    offsets, verified = build_log(tmp_path, 200)
    latest, _damaged = read_verified(tmp_path)
    assert latest is not None and latest.end == verified
    file_path = tmp_path / VERIFIED_FILE
    data = bytearray(file_path.read_bytes())
    slot = latest.sequence % 2
    data[slot * SLOT_SIZE + 20] ^= 0xFF  # the newest slot torn: the older one still checks
    file_path.write_bytes(bytes(data))
    older, damaged = read_verified(tmp_path)
    assert damaged == 1 and older is not None and older.end < verified
    with open_log(tmp_path) as log:
        assert log.recovery.verified_end == older.end
        assert log.recovery.checked_bytes == log.end_offset - older.end
        assert log.end_offset == offsets[-1] + RECORD


def test_truncate_lowers_the_verified_end_before_it_cuts(tmp_path: Path) -> None:
    offsets, verified = build_log(tmp_path, 200)
    cut_to = offsets[100]
    assert cut_to < verified
    with open_log(tmp_path) as log:
        log.truncate(cut_to)
        assert log.verified_end == cut_to
        # Other records at the same offsets (a replica following a new master), then a torn one.
        for i in range(3):
            log.append_record(RecordKind.MESSAGE, payload(500 + i))
        log.flush()
        end = log.end_offset
    with open(segment(tmp_path), "ab") as file:
        file.write(encode(RecordKind.MESSAGE, payload(999))[:30])
    with open_log(tmp_path) as log:
        assert log.recovery.verified_end == cut_to
        assert log.end_offset == end
        assert [r.payload for r in log.iter_from(0)] == [payload(i) for i in range(100)] + [
            payload(500 + i) for i in range(3)
        ]


# A child appends and flushes records, then a batch that its file-size limit cuts short:
# the kernel writes part of it, and the next write of the rest kills it with SIGXFSZ.
CHILD = """
import resource, signal, sys
from delaymq.protocol.envelope import RecordKind, encode
from delaymq.storage.log import SegmentedLog

log = SegmentedLog.open(sys.argv[1], segment_size=%d, checkpoint_bytes=%d)
for i in range(200):
    log.append_record(RecordKind.MESSAGE, b"r%%05d" %% i + b"~" * 82)
    log.flush()
print(log.end_offset, log.verified_end, flush=True)
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it: a write past the limit then kills
resource.setrlimit(resource.RLIMIT_FSIZE, (log.end_offset + 1000, resource.RLIM_INFINITY))
log.append(b"".join(encode(RecordKind.MESSAGE, b"big %%03d" %% i + b"~" * 500) for i in range(100)))
print("not reached", flush=True)
""" % (SEGMENT_SIZE, CHECKPOINT)


def test_a_write_cut_short_by_a_killed_process_is_cut_after_the_verified_end(tmp_path: Path) -> None:
    child = subprocess.run(
        [sys.executable, "-P", "-c", CHILD, str(tmp_path)], capture_output=True, timeout=60, cwd=tmp_path
    )
    assert child.returncode == -signal.SIGXFSZ, child.stderr.decode()
    end, verified = map(int, child.stdout.split())
    path = segment(tmp_path)
    assert path.stat().st_size == end + 1000  # the torn batch: part of it reached the file
    assert 0 < verified < end
    big = HEADER_SIZE + 507
    whole = 1000 // big  # records of the torn batch that reached the file whole
    with open_log(tmp_path) as log:
        assert log.recovery.verified_end == verified
        assert log.recovery.checked_bytes == end + 1000 - verified
        assert log.recovery.cut_bytes == 1000 - whole * big
        assert log.end_offset == end + whole * big
        assert [r.payload[:7] for r in log.iter_from(0)] == [b"r%05d~" % i for i in range(200)] + [
            b"big %03d" % i for i in range(whole)
        ]
