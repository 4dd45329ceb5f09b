"""``delaymq bench backlog``: the backlog job over a scheduler folder of N messages spread over 30 days.

The folder is made with the scheduler's own storage (message log, replay into hourly
schedule logs, dispatch logs for the first day, as if it had been delivered), then
the job runs on a local Spark using every core. Figures: how fast the folder was
made, the job's wall time and the scheduled records it read per second.
``DELAYMQ_BENCH_BACKLOG`` sets N (default 10,000,000).
"""

from __future__ import annotations

import io
import os
import random
import struct
import time
from pathlib import Path

from delaymq.protocol.envelope import HEADER_SIZE, RecordKind, encode
from delaymq.protocol.records import encode_message
from delaymq.scheduler.replay import replay_step
from delaymq.scheduler.schedulelog import ScheduleStore
from delaymq.storage.log import SegmentedLog
from delaymq.storage.state import StateStore

Row = tuple[str, float, str]
DAY_MS = 86_400_000
HOUR_MS = 3_600_000
SUBJECTS = tuple(f"subject-{i:02d}" for i in range(12))
_TIMES = struct.Struct(">qq")  # deliver_at, created_at at payload offset 0


def make_scheduler_folder(root: Path, *, count: int, start_ms: int, days: int = 30, seed: int = 5) -> int:
    """A scheduler data folder holding ``count`` messages of 100-byte bodies due uniformly over
    ``days`` from ``start_ms``, filed by hour; the first day's hours dispatched. Returns the entries dispatched."""
    rng = random.Random(seed)
    templates = []
    for subject in SUBJECTS:
        record = encode_message("m0000000000", subject, body=b"x" * 100, deliver_at=1, created_at=1)
        templates.append(bytearray(record[HEADER_SIZE:]))
    id_at = 34  # the id starts right after the 34-byte message header in the payload
    span = days * DAY_MS
    message = int(RecordKind.MESSAGE)
    with (
        SegmentedLog.open(root / "messages") as log,
        StateStore.open(root / "state", extra_format={"scheduler_state": 1}) as state,
    ):
        store = ScheduleStore.open(root / "schedule", state, fsync=False)
        try:
            batch: list[bytes] = []
            for n in range(count):
                payload = templates[n % len(templates)]
                _TIMES.pack_into(payload, 0, start_ms + int(rng.random() * span), start_ms - rng.randrange(DAY_MS))
                payload[id_at : id_at + 11] = b"m%010d" % n
                batch.append(encode(message, payload))
                if len(batch) == 50_000:
                    log.append(b"".join(batch))
                    batch.clear()
            if batch:
                log.append(b"".join(batch))
            log.flush()
            while not replay_step(log, store, max_bytes=64 << 20).idle:
                pass
            dispatched = 0
            for hour in store.hours_with_messages():
                if hour < (start_ms + DAY_MS) // HOUR_MS:
                    dispatched += store.record_dispatched(hour, range(store.entries(hour)))
            store.flush_dispatched()
        finally:
            store.close()
    return dispatched


def bench_backlog(scratch: Path, *, count: int | None = None) -> list[Row]:
    from delaymq.backlog import job, plan

    count = count if count is not None else int(os.environ.get("DELAYMQ_BENCH_BACKLOG", "10000000"))
    start_ms = (int(time.time() * 1000) // HOUR_MS + 1) * HOUR_MS
    folder = scratch / "scheduler-1"
    began = time.perf_counter()
    make_scheduler_folder(folder, count=count, start_ms=start_ms)
    made = time.perf_counter() - began
    spark, owned = job.open_session("local[*]")
    try:
        began = time.perf_counter()
        shown = job.run(spark, [plan.parse_source(plan.SCHEDULER, str(folder))], out=str(scratch / "out"),
                        at_ms=start_ms + 2 * DAY_MS, stream=io.StringIO())  # fmt: skip
        wall = time.perf_counter() - began
    finally:
        if owned:
            spark.stop()
    read = shown.pending + shown.dispatched
    return [
        (f"{count:,} over 30 days: folder made", count / made, "msg/s"),
        (f"{count:,} over 30 days: job wall time", wall, "s"),
        (f"{count:,} over 30 days: records read", read / wall, "records/s"),
        ("hours with messages to deliver", shown.hours, "hours"),
    ]


__all__ = ["bench_backlog", "make_scheduler_folder"]
