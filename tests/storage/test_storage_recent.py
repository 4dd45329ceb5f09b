"""The bytes a log keeps in memory (``keep_recent``): what was written, never what was cut."""

from __future__ import annotations

from pathlib import Path

from delaymq.protocol.envelope import RecordKind, encode
from delaymq.storage.log import SegmentedLog
from delaymq.storage.recent import RecentBytes


def record(i: int, size: int = 60) -> bytes:
    return encode(RecordKind.OPAQUE, f"record-{i:04d}".encode().ljust(size, b"."))


def test_a_log_keeps_its_newest_bytes_and_reads_them_as_the_disk_holds_them(tmp_path: Path) -> None:
    with SegmentedLog.open(tmp_path, segment_size=2000) as log:
        log.keep_recent(1000)
        batches = [record(i) + record(i + 1000) for i in range(40)]  # rolls segments on the way
        offsets = [log.append(batch) for batch in batches]
        ends = [offset + len(batch) for offset, batch in zip(offsets, batches, strict=True)]
        held = [i for i in range(40) if log.read_recent(offsets[i], len(batches[i])) is not None]
        assert held == list(range(40 - len(held), 40))  # the newest, about the limit's worth
        assert 1000 - 2 * len(batches[0]) <= sum(len(batches[i]) for i in held) <= 1000
        for i in held:
            assert log.read_recent(offsets[i], len(batches[i])) == log.read_raw(offsets[i], len(batches[i]))[0]
        # A span across batches, and one record inside a batch.
        span = log.read_recent(offsets[-3], ends[-1] - offsets[-3])
        assert span == batches[-3] + batches[-2] + batches[-1]
        assert log.read_recent(offsets[-1] + len(record(0)), len(record(0))) == record(1039)
        assert log.read_recent(offsets[0], len(batches[0])) is None  # forgotten: read from the disk
        assert log.read_recent(ends[-1], 1) is None  # not written
        spans = [(offsets[i], len(batches[i])) for i in range(40)] + [(ends[-1], 1)]
        assert log.read_recent_many(spans) == [log.read_recent(offset, length) for offset, length in spans]


def test_bytes_cut_from_a_log_are_never_read_from_memory(tmp_path: Path) -> None:
    with SegmentedLog.open(tmp_path) as log:
        log.keep_recent(1 << 20)
        first = log.append(record(1))
        second = log.append(record(2))
        log.truncate(second)
        assert log.read_recent(first, len(record(1))) is None
        assert log.read_recent(second, len(record(2))) is None
        again = log.append(record(3))
        assert again == second
        assert log.read_recent(again, len(record(3))) == record(3)
        log.flush()
        log.append(record(4))
        log.drop_unflushed()  # as the sync writer does after a failed fsync
        assert log.read_recent(again, len(record(3))) is None


def test_a_log_keeps_nothing_unless_asked(tmp_path: Path) -> None:
    with SegmentedLog.open(tmp_path) as log:
        offset = log.append(record(1))
        assert log.read_recent(offset, len(record(1))) is None
        assert log.read_recent_many([(offset, len(record(1)))]) == [None]


def test_recent_bytes_start_afresh_after_a_gap() -> None:
    recent = RecentBytes(100)
    recent.add(0, b"abc")
    recent.add(3, bytearray(b"def"))
    assert recent.read(1, 4) == b"bcde"
    recent.add(10, memoryview(b"xyz"))  # not where the last chunk ended
    assert recent.read(0, 3) is None
    assert recent.read(10, 3) == b"xyz"
    assert len(recent) == 3


def test_whole_batches_are_read_up_to_a_batch_end_within_the_budget_and_never_past_the_end() -> None:
    recent = RecentBytes(1 << 20)
    batches = [record(i) * (i % 3 + 1) for i in range(6)]
    bases = []
    base = 1_000
    for batch in batches:
        recent.add(base, batch)
        bases.append(base)
        base += len(batch)
    ends = [b + len(batch) for b, batch in zip(bases, batches, strict=True)]
    joined = b"".join(batches)

    def span(start: int, stop: int) -> bytes:
        return joined[start - bases[0] : stop - bases[0]]

    # Up to the last batch end within the budget, from a batch start or a record inside one.
    assert recent.read_whole(bases[1], ends[-1], ends[3] - bases[1]) == span(bases[1], ends[3])
    assert recent.read_whole(bases[1], ends[-1], ends[3] - bases[1] - 1) == span(bases[1], ends[2])
    inside = bases[2] + len(record(0))
    assert recent.read_whole(inside, ends[-1], 1 << 20) == span(inside, ends[-1])
    # One batch at least, even past the budget: a reader always moves on.
    assert recent.read_whole(bases[2], ends[-1], 1) == batches[2]
    # Never past ``end`` (what is flushed): a batch that runs past it is not given.
    assert recent.read_whole(bases[0], ends[2], 1 << 20) == span(bases[0], ends[2])
    assert recent.read_whole(bases[3], ends[3] - 1, 1 << 20) is None
    # Not held: before the first batch, or past the last.
    assert recent.read_whole(bases[0] - 60, ends[-1], 1 << 20) is None
    assert recent.read_whole(ends[-1], ends[-1] + 100, 1 << 20) is None


def test_a_replicas_copy_of_its_masters_bytes_is_not_read_from_memory(tmp_path: Path) -> None:
    """Bytes a replica copies (``append(at=...)``) were checked by nobody here: they are read
    back from the disk, CRCs checked, never from memory."""
    with SegmentedLog.open(tmp_path) as log:
        log.keep_recent(1 << 20)
        own = log.append(record(1))
        copied = log.append(record(2), at=log.end_offset)
        log.flush()
        assert log.read_recent(own, len(record(1))) == record(1)
        assert log.read_recent(copied, len(record(2))) is None
        assert log.read_recent_whole(copied, log.end_offset, 1 << 20) is None
        assert log.read_raw(copied)[0] == record(2)


def test_read_many_reads_as_read_does_however_many_spans_it_is_given() -> None:
    recent = RecentBytes(5_000)  # the last 500 of 700 adds
    for n in range(700):
        recent.add(n * 10, bytes([n % 256]) * 10)
    spans = [(n * 10, 10) for n in range(700)] + [(6_985, 10), (6_995, 10)]
    got = recent.read_many(spans)
    assert got == [recent.read(offset, length) for offset, length in spans]
    assert got[0] is None and got[699] == bytes([699 % 256]) * 10
    assert got[-2] == bytes([698 % 256]) * 5 + bytes([699 % 256]) * 5 and got[-1] is None  # past the end
