"""Progress records (realtime/progress.py): encoding, splitting a large state, finding them in a log."""

from __future__ import annotations

import pytest

from delaymq.protocol.envelope import HEADER_SIZE, iter_spans
from delaymq.protocol.records import encode_message
from delaymq.realtime.progress import MESSAGE_KIND, PROGRESS_KIND, ConsumerProgress, Progress, kind_runs
from delaymq.storage.errors import CorruptLog


def state(shares: int, consumers: int) -> Progress:
    return Progress(
        reset=True,
        shares=[(i.to_bytes(16, "big"), b"s" * 100) for i in range(shares)],
        consumers=[
            ConsumerProgress((10**6 + i).to_bytes(16, "big"), b"c" * 120, i, b"e" * 32) for i in range(consumers)
        ],
        fences={"scheduler-1": 7},
    )


def decoded(records: list[bytes]) -> list[Progress]:
    return [Progress.decode(record[HEADER_SIZE:]) for record in records]


def test_a_small_state_is_one_record_that_decodes_to_itself() -> None:
    progress = state(3, 2)
    (record,) = progress.records(16 << 20)
    assert Progress.decode(record[HEADER_SIZE:]) == progress
    assert [span.kind for span in iter_spans(record)] == [PROGRESS_KIND]


def test_a_state_too_large_for_one_record_goes_out_in_chunks_the_last_keeping_every_key() -> None:
    progress = state(2_000, 1_500)
    records = progress.records(64 << 10)
    assert len(records) > 5
    assert max(len(record) for record in records[:-1]) <= 32 << 10
    assert len(records[-1]) < 20 * 3_500 + 1_000  # the last holds only the keys to keep (16 bytes each)
    parts = decoded(records)
    assert not any(part.reset for part in parts[:-1])  # upserts first: nothing deleted before all arrived
    last = parts[-1]
    assert last.reset and last.fences == {"scheduler-1": 7} and not last.shares and not last.consumers
    assert last.kept() == progress.kept()
    assert [s for part in parts for s in part.shares] == progress.shares
    assert [c for part in parts for c in part.consumers] == progress.consumers


def test_a_record_of_another_version_is_refused_by_name() -> None:
    record = Progress().encode()
    payload = bytearray(record[HEADER_SIZE:])
    payload[payload.index(b"\xa1v") + 2] = 9  # "v": 9
    with pytest.raises(CorruptLog, match="version 9"):
        Progress.decode(bytes(payload))


def test_kind_runs_splits_a_log_into_runs_of_messages_and_progress() -> None:
    message = encode_message("m", "orders", body=b"x")
    progress = Progress(fences={"g": 1}).encode()
    data = message + message + progress + message
    assert [(kind, start, end) for kind, start, end in kind_runs(data)] == [
        (MESSAGE_KIND, 0, 2 * len(message)),
        (PROGRESS_KIND, 2 * len(message), 2 * len(message) + len(progress)),
        (MESSAGE_KIND, 2 * len(message) + len(progress), len(data)),
    ]
