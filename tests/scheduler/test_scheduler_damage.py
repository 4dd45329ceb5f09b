"""Damaged files: a scheduler stopped, one file damaged on disk, started again on its folder.

What a damaged file may cost (docs/scheduler-storage.md): a record of an hour's schedule
log that does not check costs that message only; a message log cut below what was filed
from it costs no message. The server logs and counts it, and keeps serving. Real servers
on an in-memory network under ``autojump_clock`` (see conftest.py).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio

from delaymq.cli.metrics import scheduler_families
from delaymq.cli.status_command import format_scheduler
from delaymq.protocol.commands import Command
from delaymq.scheduler.hours import LOG_SUFFIX, hour_name
from delaymq.storage.log import segment_bases, segment_name
from delaymq.wheel import HOUR_MS

from ..support.polling import wait_until
from .conftest import QUIET

SECOND = 1_000


async def schedule_and_file(cluster: Any, sched: SimpleNamespace, records: list[bytes]) -> None:
    """SCHEDULE each record on its own, and wait until every one is filed."""
    async with cluster.scheduler() as scheduler:
        for record in records:
            assert (await cluster.schedule_raw([record])).metadata["results"] == ["scheduled"]
        await wait_until(lambda: scheduler.store.checkpoint == scheduler.member.log.end_offset)


async def serves_a_new_schedule(cluster: Any, sched: SimpleNamespace, receiver: Any, name: str) -> None:
    """A SCHEDULE now is answered and delivered at its moment."""
    now = cluster.clock.now_ms()
    assert (await cluster.schedule_raw([sched.message(name, now + SECOND)])).metadata["results"] == ["scheduled"]
    with trio.fail_after(60):
        got = await receiver.wait_for(len(receiver.got) + 1)
    assert got[-1].id == name and got[-1].received_at - (now + SECOND) <= 2


async def test_a_flipped_byte_in_an_hours_last_record_costs_that_message_only(
    sched: SimpleNamespace, tmp_path: Path, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    async with sched.open_cluster(tmp_path, **QUIET) as cluster:
        clock = cluster.clock
        hour = clock.now_ms() // HOUR_MS + 2
        records = [sched.message(f"m{i}", hour * HOUR_MS + 10 * SECOND + i) for i in range(5)]
        await schedule_and_file(cluster, sched, records)
        log_file = tmp_path / "scheduler" / "schedule" / (hour_name(hour) + LOG_SUFFIX)
        offset = log_file.stat().st_size - len(records[-1])  # where the hour's last record starts
        with open(log_file, "r+b") as file:  # one flipped byte in its body
            file.seek(log_file.stat().st_size - 3)
            byte = file.read(1)[0]
            file.seek(-1, os.SEEK_CUR)
            file.write(bytes([byte ^ 0x40]))
        receiver = cluster.receiver()
        caplog.set_level(logging.WARNING, logger="delaymq.scheduler")
        async with cluster.scheduler() as scheduler:
            await clock.sleep_until_ms(hour * HOUR_MS + 20 * SECOND)
            assert receiver.ids() == ["m0", "m1", "m2", "m3"]
            stats = scheduler.statistics()
            assert stats.damaged_records == 1 and stats.dispatched == 4
            assert stats.pending == 0  # the damaged one is recorded done: its hour is finished
            await serves_a_new_schedule(cluster, sched, receiver, "new")
            await clock.sleep_until_ms(clock.now_ms() + 2 * SECOND)  # the counters are saved
            status = (await cluster.net.call(sched.SCHEDULER, Command.STATUS, {})).metadata
            stats = scheduler.statistics()
            families = list(scheduler_families(stats, scheduler.frame_server.statistics(), None))
        assert f"hour {hour_name(hour)}: entry 4's record at log byte {offset}: record fails its CRC" in caplog.text
        assert status["statistics"]["damaged_records"] == 1
        assert "1 schedule-log record(s) skipped" in format_scheduler("scheduler-1", sched.SCHEDULER, status)
        metrics = {sample.name: sample.value for family in families for sample in family.samples}
        assert metrics["delaymq_scheduler_damaged_records_total"] == 1
        async with cluster.scheduler() as again:  # not met again: it is done
            assert again.statistics().damaged_records == 1
            assert again.statistics().pending == 0


async def test_a_message_log_cut_below_what_was_filed_costs_no_message(
    sched: SimpleNamespace, tmp_path: Path, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    async with sched.open_cluster(tmp_path, **QUIET) as cluster:
        clock = cluster.clock
        now = clock.now_ms()
        due = {f"m{i}": now + 10 * SECOND + i * SECOND for i in range(5)}
        records = [sched.message(name, at) for name, at in due.items()]
        await schedule_and_file(cluster, sched, records)
        messages = tmp_path / "scheduler" / "messages"
        segment = messages / segment_name(segment_bases(messages)[-1])
        filed_end = segment_bases(messages)[-1] + segment.stat().st_size
        os.truncate(segment, segment.stat().st_size - 20)  # the last record, filed, torn
        receiver = cluster.receiver()
        caplog.set_level(logging.WARNING)
        async with cluster.scheduler() as scheduler:
            stats = scheduler.statistics()
            assert stats.lost_log_bytes == len(records[-1])
            assert stats.message_log_end == stats.checkpoint == filed_end  # new records come after the lost ones
            with trio.fail_after(60):
                got = await receiver.wait_for(5)
            assert {r.id: r.deliver_at for r in got} == due  # every one, at its moment
            assert all(r.received_at - r.deliver_at <= 2 for r in got)
            await serves_a_new_schedule(cluster, sched, receiver, "new")
        assert f"ends at offset {filed_end - len(records[-1])}, below the {filed_end} it had filed" in caplog.text
        async with cluster.scheduler() as again:  # a folder like any other now
            assert again.statistics().lost_log_bytes == len(records[-1])
            assert again.statistics().message_log_end > filed_end
            await serves_a_new_schedule(cluster, sched, receiver, "newer")
