"""Codec micro-benchmarks: how many records per second each step handles.

The CLI (``delaymq bench``) prints the figures; nothing here prints. Batches
are 1,000 records of 100-byte bodies, the shape a producer sends.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from delaymq.protocol.commands import Command
from delaymq.protocol.frames import Frame, FrameDecoder, encode_frame, request
from delaymq.protocol.records import (
    Message,
    decode_batch,
    encode_batch,
    new_message_id,
    rewrite_delivery,
    scan_batch,
)

BATCH = 1_000
_EPOCH_MS = 1_767_225_600_000  # 2026-01-01T00:00:00Z: fixed, so runs compare


def bench_codec(*, records: int = 200_000) -> list[tuple[str, float, str]]:
    """(name, value, unit) for encode, scan, decode, rewrite and frame round trips."""
    records = max(records, BATCH)
    batches = [
        [
            Message(
                new_message_id(_EPOCH_MS),
                "bench.orders",
                tags=("bench",) if i % 4 == 0 else (),
                body=bytes(100),
                deliver_at=_EPOCH_MS + 2_000 + i,
                created_at=_EPOCH_MS,
            )
            for i in range(start, min(start + BATCH, records))
        ]
        for start in range(0, records, BATCH)
    ]
    count = sum(map(len, batches))
    encode_seconds = _best(lambda: [encode_batch(batch) for batch in batches])
    encoded = [encode_batch(batch) for batch in batches]
    scan_seconds = _best(lambda: [scan_batch(buf) for buf in encoded])
    decode_seconds = _best(lambda: [decode_batch(buf) for buf in encoded])
    one = encoded[0]
    scanned = scan_batch(one)
    singles = [scanned.record(i) for i in range(len(scanned))]
    rewrite_seconds = _best(lambda: [rewrite_delivery(r, deliver_at=_EPOCH_MS, attempts=1) for r in singles])

    frames = max(1, records // BATCH)
    frame = request(Command.SCHEDULE, 1, {"producer": "bench"}, one)
    frame_seconds = _best(lambda: _frame_round_trips(frame, frames))
    frame_bytes = len(encode_frame(frame))
    return [
        ("encode_batch", count / encode_seconds, "records/s"),
        ("scan_batch", count / scan_seconds, "records/s"),
        ("decode_batch", count / decode_seconds, "records/s"),
        ("rewrite_delivery", len(singles) / rewrite_seconds, "records/s"),
        ("frame_round_trip_1000_records", frames / frame_seconds, "frames/s"),
        ("frame_round_trip_bytes", frames * frame_bytes / frame_seconds / 1e6, "MB/s"),
    ]


def _frame_round_trips(frame: Frame, times: int) -> None:
    decoder = FrameDecoder()
    for _ in range(times):
        decoder.feed(encode_frame(frame))
        if decoder.next_frame() is None:  # pragma: no cover - a whole frame was fed
            raise AssertionError("frame did not decode")


def _best(run: Callable[[], object], repeat: int = 3) -> float:
    """The fastest of a few runs, in seconds: the least disturbed by the machine."""
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


__all__ = ["bench_codec"]
