"""Where the dispatcher gets due records from: arrivals linked into seconds already read
ahead are read by the loader (one thread call per round of arrivals, through readers kept
open), so the firer finds them in memory; what it must read itself (due at once) goes
through a reader of its own, opened once per hour, not once per round.

A real schedule store and a fake realtime, filing while the dispatcher runs (as the
master's replay loop does), under ``autojump_clock`` with disk work inline.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from delaymq.clock import TrioClock
from delaymq.protocol.records import encode_message, scan_batch
from delaymq.scheduler.dispatcher import Dispatcher
from delaymq.scheduler.hourlog import HourLog
from delaymq.scheduler.replay import replay_step
from delaymq.scheduler.schedulelog import ScheduleStore
from delaymq.scheduler.wheelset import WheelSet
from delaymq.storage.log import SegmentedLog
from delaymq.storage.threads import run_inline

from .conftest import schedule_folder

EPOCH_MS = 1_749_996_000_000  # 2025-06-15 14:00 UTC


def message(name: str, deliver_at: int) -> bytes:
    return encode_message(name, "orders", deliver_at=deliver_at, created_at=EPOCH_MS, body=name.encode() * 20)


@dataclass
class Running:
    dispatcher: Dispatcher
    clock: TrioClock
    log: SegmentedLog
    store: ScheduleStore
    delivered: dict[str, bytes]  # id -> the record realtime was sent
    changed: trio.Condition

    def file(self, records: list[bytes]) -> None:
        """Append, file and tell the wheel, as the master's replay loop does."""
        self.log.append(b"".join(records))
        self.log.flush()
        step = replay_step(self.log, self.store)
        for hour, arrivals in step.arrivals.items():
            self.dispatcher.wheels.arrive(hour, arrivals.first_entry, arrivals.ms_in_hour)
        self.dispatcher.poke()

    async def wait_until(self, done: object) -> None:
        with trio.fail_after(120):  # on the mock clock
            async with self.changed:
                while not done():  # type: ignore[operator]
                    await self.changed.wait()


@asynccontextmanager
async def running(tmp_path: Path, records: list[bytes], **options: Any) -> AsyncIterator[Running]:
    clock = TrioClock(EPOCH_MS)
    delivered: dict[str, bytes] = {}
    changed = trio.Condition()

    async def deliver(subject: str, body: bytes) -> list[str]:
        batch = scan_batch(body)
        delivered.update((record_id, body[a:b]) for record_id, a, b in zip(batch.ids, batch.starts, batch.ends))
        async with changed:
            changed.notify_all()
        return ["stored"] * len(batch)

    with schedule_folder(tmp_path, fsync=False) as (log, store):
        log.append(b"".join(records))
        log.flush()
        replay_step(log, store)
        wheels = WheelSet(store.undispatched_hours())
        dispatcher = Dispatcher(
            store=store, wheels=wheels, deliver=deliver, clock=clock, run_blocking=run_inline, **options
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(dispatcher.run)
            yield Running(dispatcher, clock, log, store, delivered, changed)
            nursery.cancel_scope.cancel()


async def test_arrivals_linked_into_loaded_seconds_fire_from_memory_with_their_own_bytes(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    first = message("first", EPOCH_MS + 2_000)
    async with running(tmp_path, [first]) as run:
        # Second 2 is within the load-ahead (3 s): read ahead with its record.
        wheels = run.dispatcher.wheels
        with trio.fail_after(5):
            while not (wheels.open_hours() and wheels.wheel(wheels.open_hours()[0]).is_loaded(2)):
                await trio.lowlevel.checkpoint()
        later = [message(f"late{i}", EPOCH_MS + 2_000 + 200 * i) for i in range(1, 9)]
        run.file(later[:4])  # linked into second 2, already loaded
        run.file(later[4:])  # ... and into seconds 2 and 3, in a second round
        await run.wait_until(lambda: len(run.delivered) == 9)
        stats = run.dispatcher.statistics()
    sent = dict(zip(["first"] + [f"late{i}" for i in range(1, 9)], [first, *later]))
    assert run.delivered == sent  # every record, byte for byte
    assert stats.fire_reads == 0  # every record was in memory when it fell due
    assert stats.cached_records == 0 and stats.cached_bytes == 0  # nothing left behind


async def test_records_the_firer_must_read_go_through_one_reader_kept_open(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, monkeypatch: object
) -> None:
    opened: list[int] = []
    original = HourLog.__init__

    def counting_init(self: HourLog, store: object, hour: int) -> None:
        opened.append(hour)
        original(self, store, hour)  # type: ignore[arg-type]

    monkeypatch.setattr(HourLog, "__init__", counting_init)  # type: ignore[attr-defined]
    # No memory for records read ahead: the firer reads every record itself.
    async with running(tmp_path, [message("first", EPOCH_MS + 1_000)], max_cached_bytes=0) as run:
        await run.wait_until(lambda: len(run.delivered) == 1)
        for round_no in range(5):  # each round: records due already
            now = run.clock.now_ms()
            run.file([message(f"r{round_no}-{i}", now - 500 + i) for i in range(3)])
            await run.wait_until(lambda n=round_no: len(run.delivered) == 1 + 3 * (n + 1))
        stats = run.dispatcher.statistics()
    assert sorted(run.delivered) == sorted(["first"] + [f"r{n}-{i}" for n in range(5) for i in range(3)])
    assert stats.fire_reads >= 6  # the firer read them itself, round after round ...
    assert len(opened) == 2  # ... through one reader of its own, beside the loader's


async def test_records_read_ahead_for_entries_held_back_are_let_go(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """A cancelled message's record, read ahead, leaves the cache when its moment passes:
    the read-ahead budget is not spent on messages that will never be sent."""
    records = [message(f"m{i}", EPOCH_MS + 3_000 + i) for i in range(10)]
    async with running(tmp_path, records) as run:
        held_back: list[int] = []

        def skip(hour: int, items: list[tuple[int, int]]) -> list[tuple[int, int]]:
            cancelled = [item for item in items if item[0] % 2]  # m1, m3, ... (due at odd ms)
            held_back.extend(entry for _at, entry in cancelled)
            run.dispatcher.wheels.confirm(hour, cancelled)  # done, as a cancel does
            return [item for item in items if item not in cancelled]

        run.dispatcher.skip = skip
        await run.wait_until(lambda: len(run.delivered) == 5)
        await run.clock.sleep_until_ms(EPOCH_MS + 3_100)  # past the last one's moment
        stats = run.dispatcher.statistics()
    assert len(held_back) == 5 and sorted(run.delivered) == [f"m{i}" for i in range(0, 10, 2)]
    assert stats.fire_reads == 0  # they were read ahead ...
    assert stats.cached_records == 0 and stats.cached_bytes == 0  # ... and none is left behind
