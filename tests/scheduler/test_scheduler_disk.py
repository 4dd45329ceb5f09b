"""Disk: the scheduler's message log holds little more than what is not yet filed.

Filed message-log segments are deleted within a minute of being filed (a master rolls a
segment that a small load would take days to fill), so after filing the data folder
holds the schedule logs and their indexes, not a second copy of every message. A folder
written with the old 1 GiB segments opens and takes the new size. Real servers on an
in-memory network under ``autojump_clock``.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import trio
import trio.testing

from delaymq.protocol.records import encode_message
from delaymq.scheduler.delayindex import ENTRY_SIZE
from delaymq.scheduler.server import SCHEDULER_SEGMENT_SIZE
from delaymq.storage.errors import FormatMismatch
from delaymq.storage.format import read_format
from delaymq.wheel import HOUR_MS

BODY = b"x" * 100  # the benchmark's 100-byte message
SEGMENT = 64 << 10  # small segments: the 20,000 messages fill a dozen


def message(n: int, deliver_at: int, created_at: int) -> bytes:
    return encode_message(f"{n:032x}", "orders", body=BODY, deliver_at=deliver_at, created_at=created_at)


def disk_usage(folder: Path) -> int:
    """Bytes the folder takes on disk, as ``du`` counts them (allocated blocks)."""
    return sum(os.stat(Path(root) / name).st_blocks * 512 for root, _dirs, files in os.walk(folder) for name in files)


def segment_files(messages: Path) -> dict[str, int]:
    return {path.name: path.stat().st_size for path in sorted(messages.iterdir()) if path.name.isdigit()}


async def test_filed_segments_go_within_a_minute_and_the_folder_stays_under_2_5x_the_message_bytes_plus_the_index(
    sched: SimpleNamespace, tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    data = tmp_path / "scheduler"
    async with sched.open_cluster(tmp_path) as cluster, cluster.scheduler(segment_size=SEGMENT) as scheduler:
        clock = cluster.clock
        start = clock.now_ms()
        rng = random.Random(5)
        count = 20_000
        for first in range(0, count, 1_000):  # due over the next two hours
            now = clock.now_ms()
            await cluster.schedule_raw(
                [message(n, now + 60_000 + rng.randrange(2 * HOUR_MS), now) for n in range(first, first + 1_000)]
            )
        await trio.testing.wait_all_tasks_blocked()  # replay has caught up
        stats = scheduler.statistics()
        assert (stats.filed, stats.unfiled_bytes) == (count, 0)
        assert stats.message_log_segments > 10  # rolled by size while they came in
        await clock.sleep_ms(2_000)
        assert len(segment_files(data / "messages")) == 1  # the full ones went within a second or two

        await clock.sleep_until_ms(start + 61_000)  # filed at `start`: the cleanup round a minute later
        assert sum(segment_files(data / "messages").values()) == 0  # the active one was rolled and went too
        ids = disk_usage(data / "state")  # lmdb: mostly the id index (docs/cancel.md), about 70 bytes an id
        assert ids < count * 96 + (256 << 10), ids
        used = disk_usage(data) - ids
        index = count * ENTRY_SIZE
        assert used < 2.5 * count * len(BODY) + index, (used, count * len(BODY), index)

        # A trickle that would take days to fill a segment goes within a minute too.
        later = clock.now_ms()
        await cluster.schedule_raw([message(count + n, later + 3 * HOUR_MS, later) for n in range(5)])
        assert sum(segment_files(data / "messages").values()) > 0
        await clock.sleep_until_ms(later + 61_000)
        assert sum(segment_files(data / "messages").values()) == 0
        assert scheduler.statistics().filed == count + 5


async def test_a_folder_written_with_1_gib_segments_opens_takes_the_new_size_and_loses_nothing(
    sched: SimpleNamespace, tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    messages = tmp_path / "scheduler" / "messages"
    async with sched.open_cluster(tmp_path) as cluster:
        clock = cluster.clock
        now = clock.now_ms()
        receiver = cluster.receiver()
        async with cluster.scheduler(segment_size=1 << 30):  # a folder written with another segment size
            await cluster.schedule_raw([sched.message(f"old-{i}", now + 90_000 + i) for i in range(10)])
        assert read_format(messages)["segment_size"] == 1 << 30
        (old_segment,) = segment_files(messages)

        async with cluster.scheduler() as scheduler:
            assert read_format(messages)["segment_size"] == SCHEDULER_SEGMENT_SIZE
            await cluster.schedule_raw([sched.message(f"new-{i}", now + 100_000 + i) for i in range(10)])
            await receiver.wait_for(20)
            await clock.sleep_until_ms(now + 121_000)  # a cleanup round after both were filed
            assert old_segment not in segment_files(messages)
            assert scheduler.statistics().deleted_segments >= 1
        assert sorted(receiver.ids()) == sorted([f"old-{i}" for i in range(10)] + [f"new-{i}" for i in range(10)])

        # Only the segment size is taken over: any other difference is still refused.
        stored = read_format(messages)
        assert stored is not None
        (messages / "FORMAT").write_text(json.dumps({**stored, "max_record": 1 << 10}))
        with pytest.raises(FormatMismatch, match="max_record"):
            async with cluster.scheduler():
                pass
