"""SegmentedLog: appends, reads and iteration across segment rolls, deletion, formats."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from delaymq.protocol.envelope import HEADER_SIZE, RecordKind, encode
from delaymq.storage.errors import (
    DirectoryLocked,
    FormatMismatch,
    FormatUnreadable,
    LogClosed,
    NotRecordStart,
    OffsetBeyondEnd,
    OffsetDeleted,
    RecordTooLarge,
)
from delaymq.storage.format import read_format
from delaymq.storage.log import Record, SegmentedLog


def payload(i: int, size: int = 40) -> bytes:
    return f"record-{i:06d}-".encode().ljust(size, b".")


def segment_files(directory: Path) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.isdigit())


def test_append_read_and_iterate_across_segment_rolls(tmp_path: Path) -> None:
    with SegmentedLog.open(tmp_path, segment_size=4096) as log:
        offsets = [log.append_record(RecordKind.MESSAGE, payload(i, 100)) for i in range(200)]
        assert offsets[0] == 0
        assert log.end_offset == 200 * (HEADER_SIZE + 100)
        files = segment_files(tmp_path)
        assert len(files) == len(log.segments()) > 5
        assert files == [f"{base:020d}" for base, _size in log.segments()]
        for base, size in log.segments():
            assert size <= 4096
            assert (tmp_path / f"{base:020d}").stat().st_size == size
        for i, offset in enumerate(offsets):
            assert log.read(offset) == Record(offset, RecordKind.MESSAGE, payload(i, 100), offset + 112)
        assert [r.payload for r in log.iter_from(0)] == [payload(i, 100) for i in range(200)]
        assert [r.offset for r in log.iter_from(offsets[57])] == offsets[57:]
        # Small chunks still yield every record (a chunk is widened to fit one record).
        assert [r.offset for r in log.iter_from(0, chunk_size=50)] == offsets


def test_a_batch_is_one_append_and_a_batch_bigger_than_a_segment_gets_its_own(tmp_path: Path) -> None:
    with SegmentedLog.open(tmp_path, segment_size=1000) as log:
        first = log.append(encode(RecordKind.OPAQUE, b"small"))
        big = b"".join(encode(RecordKind.OPAQUE, payload(i, 300)) for i in range(10))
        big_offset = log.append(big)
        after = log.append(encode(RecordKind.OPAQUE, b"after"))
        assert log.segments() == [(first, big_offset), (big_offset, len(big)), (after, 17)]
        assert [r.payload for r in log.iter_from(big_offset)] == [
            *(payload(i, 300) for i in range(10)),
            b"after",
        ]


def test_read_raw_returns_whole_records_and_moves_across_segments(tmp_path: Path) -> None:
    with SegmentedLog.open(tmp_path, segment_size=1000) as log:
        records = [encode(RecordKind.OPAQUE, payload(i, 88)) for i in range(30)]  # 100 bytes each
        for record in records:
            log.append(record)
        data, next_offset = log.read_raw(0, 250)
        assert (data, next_offset) == (b"".join(records[:2]), 200)
        # The first record comes whole even when it is bigger than max_bytes.
        assert log.read_raw(200, 10) == (records[2], 300)
        collected = b""
        offset = 0
        while True:
            data, offset = log.read_raw(offset, 512)
            if not data:
                break
            collected += data
        assert collected == b"".join(records)
        assert offset == log.end_offset
        assert log.read_raw(log.end_offset) == (b"", log.end_offset)


def test_reads_at_bad_offsets_name_the_offset_and_the_range(tmp_path: Path) -> None:
    with SegmentedLog.open(tmp_path, segment_size=4096) as log:
        for i in range(5):
            log.append_record(RecordKind.OPAQUE, payload(i))
        end = log.end_offset
        with pytest.raises(NotRecordStart, match=rf"offset 7 is not the start .*\[0, {end}\)"):
            log.read(7)
        with pytest.raises(NotRecordStart):
            log.read_raw(7)
        with pytest.raises(OffsetBeyondEnd, match=rf"offset {end} .*\[0, {end}\)"):
            log.read(end)
        with pytest.raises(OffsetBeyondEnd, match=rf"offset {end + 1} "):
            log.read_raw(end + 1)
        with pytest.raises(OffsetBeyondEnd):
            log.iter_from(end + 1)  # checked at the call, not at the first next()
        assert list(log.iter_from(end)) == []


def test_delete_before_removes_whole_old_segments_only(tmp_path: Path) -> None:
    with SegmentedLog.open(tmp_path, segment_size=1000) as log:
        offsets = [log.append_record(RecordKind.OPAQUE, payload(i, 88)) for i in range(50)]
        segments = log.segments()
        assert len(segments) == 5
        # Offset 2500 lies inside the third segment: only the first two go.
        assert log.delete_before(2500) == 2
        assert log.start_offset == segments[2][0] == 2000
        assert segment_files(tmp_path) == [f"{base:020d}" for base, _ in segments[2:]]
        with pytest.raises(OffsetDeleted, match=r"offset 1900 .*\[2000, 5000\)"):
            log.read(offsets[19])
        with pytest.raises(OffsetDeleted):
            log.iter_from(0)
        assert log.read(2000).payload == payload(20, 88)
        # The active segment stays even when everything lies below the offset.
        assert log.delete_before(10**9) == 2
        assert log.segments() == [segments[-1]]
        assert [r.offset for r in log.iter_from(log.start_offset)] == offsets[40:]
        assert log.delete_before(10**9) == 0
    with SegmentedLog.open(tmp_path, segment_size=1000) as log:
        assert (log.start_offset, log.end_offset) == (4000, 5000)
        assert log.append_record(RecordKind.OPAQUE, b"next") == 5000


def test_empty_folder_opens_as_an_empty_log(tmp_path: Path) -> None:
    folder = tmp_path / "new" / "log"
    with SegmentedLog.open(folder) as log:
        assert (log.start_offset, log.end_offset, log.flushed_offset) == (0, 0, 0)
        assert list(log.iter_from(0)) == []
        with pytest.raises(OffsetBeyondEnd):
            log.read(0)
    assert read_format(folder) == {
        "format": "segmented-log",
        "version": 1,
        "segment_size": 1 << 30,
        "max_record": 16 << 20,
    }


def test_flush_moves_flushed_offset(tmp_path: Path) -> None:
    with SegmentedLog.open(tmp_path, segment_size=4096) as log:
        log.append_record(RecordKind.OPAQUE, b"a")
        assert log.flushed_offset == 0
        assert log.flush() == log.end_offset == log.flushed_offset == 13


def test_oversize_records_are_refused_before_they_reach_the_disk(tmp_path: Path) -> None:
    with SegmentedLog.open(tmp_path, segment_size=4096, max_record=100) as log:
        with pytest.raises(RecordTooLarge, match="payload of 101 bytes exceeds max_record 100"):
            log.append_record(RecordKind.OPAQUE, bytes(101))
        batch = encode(RecordKind.OPAQUE, bytes(50)) + encode(RecordKind.OPAQUE, bytes(150))
        with pytest.raises(RecordTooLarge, match="batch byte 62 .* 150 bytes; max_record is 100"):
            log.append(batch)
        with pytest.raises(ValueError, match="data is empty"):
            log.append(b"")
        assert log.end_offset == 0


def test_other_segment_size_is_refused_naming_the_parameter(tmp_path: Path) -> None:
    with SegmentedLog.open(tmp_path, segment_size=4096) as log:
        log.append_record(RecordKind.OPAQUE, b"kept")
    with pytest.raises(FormatMismatch, match="segment_size: stored 4096, requested 8192") as caught:
        SegmentedLog.open(tmp_path, segment_size=8192)
    assert caught.value.differences == [("segment_size", 4096, 8192)]
    with pytest.raises(FormatMismatch, match="entry_version: stored absent, requested 2"):
        SegmentedLog.open(tmp_path, segment_size=4096, extra_format={"entry_version": 2})
    with SegmentedLog.open(tmp_path, segment_size=4096) as log:  # refusals left it as it was
        assert [r.payload for r in log.iter_from(0)] == [b"kept"]


def test_segments_without_a_format_file_are_refused(tmp_path: Path) -> None:
    with SegmentedLog.open(tmp_path, segment_size=4096) as log:
        log.append_record(RecordKind.OPAQUE, b"x")
    (tmp_path / "FORMAT").unlink()
    with pytest.raises(FormatUnreadable, match="holds data but no FORMAT file"):
        SegmentedLog.open(tmp_path, segment_size=4096)


def test_one_open_log_per_folder_and_no_use_after_close(tmp_path: Path) -> None:
    log = SegmentedLog.open(tmp_path, segment_size=4096)
    with pytest.raises(DirectoryLocked, match="already open"):
        SegmentedLog.open(tmp_path, segment_size=4096)
    log.close()
    log.close()
    with pytest.raises(LogClosed):
        log.append_record(RecordKind.OPAQUE, b"x")
    with pytest.raises(LogClosed):
        log.read(0)
    SegmentedLog.open(tmp_path, segment_size=4096).close()


# --------------------------------------------------------------- model-based

batches = st.lists(st.binary(max_size=120), min_size=1, max_size=6)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("append"), batches),
        st.tuples(st.just("reopen"), st.none()),
        st.tuples(st.just("delete"), st.floats(0, 1)),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=operations, segment_size=st.sampled_from([64, 300, 2048]))
def test_sequences_of_batches_match_a_model(
    tmp_path_factory: pytest.TempPathFactory, ops: list[tuple[str, object]], segment_size: int
) -> None:
    directory = tmp_path_factory.mktemp("model")
    model: list[tuple[int, bytes]] = []  # (offset, payload) of every record appended
    end = 0
    log = SegmentedLog.open(directory, segment_size=segment_size)
    try:
        for op, arg in ops:
            if op == "append":
                assert isinstance(arg, list)
                records = [encode(RecordKind.OPAQUE, p) for p in arg]
                assert log.append(b"".join(records)) == end
                for p, record in zip(arg, records):
                    model.append((end, p))
                    end += len(record)
            elif op == "reopen":
                log.close()
                log = SegmentedLog.open(directory, segment_size=segment_size)
            else:
                assert isinstance(arg, float)
                below = int(end * arg)
                log.delete_before(below)
                segments = log.segments()
                # Every segment wholly below the offset went, and no other one.
                assert len(segments) == 1 or sum(segments[0]) > below
            assert log.end_offset == end
            start = log.start_offset
            kept = [(o, p) for o, p in model if o >= start]
            assert [(r.offset, r.payload) for r in log.iter_from(start)] == kept
            for o, p in kept[:3] + kept[-3:]:
                assert log.read(o).payload == p
            for o, _p in model:
                if o < start:
                    with pytest.raises(OffsetDeleted):
                        log.read(o)
            # Records never span segments; a segment overflows only with one batch.
            bounds = log.segments()
            for o, p in kept:
                base, size = next((b, s) for b, s in bounds if b <= o < b + s)
                assert o + HEADER_SIZE + len(p) <= base + size
    finally:
        log.close()
