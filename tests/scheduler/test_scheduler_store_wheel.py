"""The store feeding the wheel, as the dispatcher will: heads -> counts, chains -> loaded
seconds, replay arrivals -> link / note_arrival, dispatch log -> skip on restart."""

from __future__ import annotations

import queue
import threading
from pathlib import Path
from types import SimpleNamespace

from delaymq.protocol.records import decode_message, encode_message
from delaymq.scheduler.hourlog import HourLog
from delaymq.scheduler.hours import HOUR_MS
from delaymq.scheduler.replay import replay_step, replay_until_caught_up
from delaymq.wheel import HourWheel, SecondWheel

BASE = 1_750_000_000_000 - 1_750_000_000_000 % HOUR_MS
HOUR = BASE // HOUR_MS


def message(name: str, deliver_at: int) -> bytes:
    return encode_message(name, "s", deliver_at=deliver_at, created_at=BASE)


def load_due_seconds(wheel: SecondWheel, reader: HourLog, known: int, now_ms: int) -> None:
    for second in wheel.seconds_to_load(now_ms):
        wheel.load_second(second, reader.chain(second, below=known, floor=wheel.walk_floor(second)))


def test_dispatch_an_hour_through_the_wheel_and_resume_after_restart(tmp_path: Path, sched: SimpleNamespace) -> None:
    first = [message(f"a{i}", BASE + 1_000 + (i * 37) % 50_000) for i in range(300)]
    later = [message(f"b{i}", BASE + 2_000 + i) for i in range(20)]  # second 2: loaded by then
    later += [message(f"c{i}", BASE + 3_000_000 + i) for i in range(5)]  # far: not loaded yet
    with sched.folder(tmp_path) as (log, store):
        log.append(b"".join(first))
        log.flush()
        replay_until_caught_up(log, store)
        hours = HourWheel(store.undispatched_hours())
        assert hours.due_hours(BASE, 60_000) == [HOUR]
        with store.open_hour(HOUR) as reader:
            heads = reader.heads()
            wheel = SecondWheel.from_counts(HOUR, heads.counts)
            known = heads.entries
            now = BASE + 2_500
            load_due_seconds(wheel, reader, known, now)

            log.append(b"".join(later))
            log.flush()
            step = replay_step(log, store)
            for ms, entry_no in step.arrivals[HOUR].pairs():
                if entry_no < known:
                    continue  # already in the heads snapshot
                second = ms // 1000
                if wheel.is_loaded(second):
                    wheel.link(second, ms, entry_no)
                else:
                    wheel.note_arrival(second)
                known += 1
            assert known == store.entries(HOUR) == 325

            # Fire the first half of the hour: everything due, in firing order.
            fired: list[tuple[int, int]] = []
            while (due_at := wheel.next_due_ms()) is not None and due_at < BASE + 1_800_000:
                load_due_seconds(wheel, reader, known, due_at)
                due = wheel.pop_due(due_at)
                records = reader.read_records([e for _, e in due])
                for (at, _e), record in zip(due, records):
                    assert decode_message(record).deliver_at == at
                store.record_dispatched(HOUR, [e for _, e in due])
                wheel.mark_done_many(due)
                fired.extend(due)
            assert len(fired) == 320 and fired == sorted(fired)
            store.flush_dispatched()
            assert store.pending(HOUR) == 5

    # Restart: a new wheel from the heads skips what the dispatch log holds.
    with sched.folder(tmp_path) as (_, store), store.open_hour(HOUR) as reader:
        assert store.undispatched_hours() == [HOUR]
        heads = reader.heads()
        wheel = SecondWheel.from_counts(HOUR, heads.counts)
        wheel.mark_delivered(store.delivered(HOUR))
        load_due_seconds(wheel, reader, heads.entries, BASE + HOUR_MS)
        rest = wheel.pop_due(BASE + HOUR_MS)
        assert [e for _, e in rest] == list(range(320, 325))
        names = [decode_message(r).id for r in reader.read_records([e for _, e in rest])]
        assert names == [f"c{i}" for i in range(5)]


def test_a_reader_in_another_thread_sees_consistent_snapshots_while_replay_files(
    tmp_path: Path, sched: SimpleNamespace
) -> None:
    records = [message(f"m{i}", BASE + (i * 7) % 5_000) for i in range(6_000)]
    with sched.folder(tmp_path, fsync=False) as (log, store):
        log.append(b"".join(records[:10]))
        log.flush()
        replay_until_caught_up(log, store)
        for i in range(10, len(records), 100):
            log.append(b"".join(records[i : i + 100]))
        log.flush()
        problems: list[str] = []
        steps: queue.Queue[bool] = queue.Queue()

        def read() -> None:
            # One snapshot per replay step, taken while the next step runs.
            with store.open_hour(HOUR) as reader:
                while steps.get():
                    heads = reader.heads()
                    if heads.entries > reader.entries:
                        problems.append(f"heads count {heads.entries} > entries {reader.entries}")
                    for second in heads.seconds():
                        got = reader.chain(second, below=heads.entries)
                        if len(got) != heads.counts[second]:
                            problems.append(f"second {second}: {len(got)} != {heads.counts[second]}")
                    reader.read_records(list(range(heads.entries)))

        thread = threading.Thread(target=read)
        thread.start()
        try:
            while not replay_step(log, store, max_bytes=20_000).idle:
                steps.put(True)
        finally:
            steps.put(False)
            thread.join()
        assert problems == []
        assert store.entries(HOUR) == len(records)
