"""Property: whatever the deliver_at values, batching and crashes, each record is filed
exactly once, into the right hour and second, and every chain is complete."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from delaymq.protocol.limits import TWO_YEARS_MS
from delaymq.protocol.records import encode_message
from delaymq.scheduler.hours import HOUR_MS, hour_name, parse_hour_name
from delaymq.scheduler.replay import replay_step
from delaymq.scheduler.schedulelog import ScheduleStore
from delaymq.storage.log import SegmentedLog
from delaymq.storage.state import StateStore

NOW = 1_750_000_123_456


class Crash(BaseException):
    """The process died at this point."""


class CrashingState:
    """A StateStore whose next write transaction never happens (the process died first)."""

    def __init__(self, state: StateStore) -> None:
        self._state = state

    def write(self) -> object:
        raise Crash()

    def __getattr__(self, name: str) -> object:
        return getattr(self._state, name)


def open_store(root: Path, state: StateStore, step_hours: int) -> ScheduleStore:
    # fsync off: the property is about what lands in the files, and it keeps examples fast.
    return ScheduleStore.open(root / "schedule", state, max_step_hours=step_hours, fsync=False)


DELIVER_AT = st.one_of(
    st.integers(NOW - 3 * HOUR_MS, NOW + TWO_YEARS_MS),  # anywhere in two years, or just past
    st.integers(NOW, NOW + 5_000),  # crowded seconds
    st.just(0),  # immediate: filed at created_at
)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    deliver_ats=st.integers(1, 300).flatmap(lambda n: st.lists(DELIVER_AT, min_size=n, max_size=n)),
    batch=st.integers(1, 50),
    step_bytes=st.integers(1, 20_000),
    step_hours=st.integers(1, 8),
    crash_at=st.one_of(st.none(), st.integers(0, 30)),
    tear=st.one_of(st.none(), st.tuples(st.integers(0, 1000), st.integers(1, 300))),
)
def test_every_record_filed_once_in_its_hour_and_second(
    deliver_ats: list[int],
    batch: int,
    step_bytes: int,
    step_hours: int,
    crash_at: int | None,
    tear: tuple[int, int] | None,
) -> None:
    """``crash_at``: the step whose lmdb commit never happens (its files were written);
    ``tear``: then cut (file choice, bytes) off one schedule log or index, torn or damaged."""
    records = [
        encode_message(f"m{i}", "s", deliver_at=at, created_at=NOW, body=bytes(i % 7))
        for i, at in enumerate(deliver_ats)
    ]
    with tempfile.TemporaryDirectory() as name:
        root = Path(name)
        with (
            SegmentedLog.open(root / "messages", segment_size=8192) as log,
            StateStore.open(root / "state") as state,
        ):
            for i in range(0, len(records), batch):
                log.append(b"".join(records[i : i + batch]))
            log.flush()
            store = open_store(root, state, step_hours)
            steps = 0
            while True:
                if steps == crash_at:
                    store._state = CrashingState(state)  # type: ignore[assignment]
                    store._abort = store._clear_step  # type: ignore[method-assign]  # nothing cleans up
                    try:
                        replay_step(log, store, max_bytes=step_bytes)
                    except Crash:
                        event("crashed mid-step")
                    store.close()
                    if tear is not None:
                        files = sorted(p for p in (root / "schedule").iterdir() if p.suffix in (".log", ".index"))
                        if files:
                            victim = files[tear[0] % len(files)]
                            os.truncate(victim, max(0, victim.stat().st_size - tear[1]))
                            event("tore a file")
                    store = open_store(root, state, step_hours)
                step = replay_step(log, store, max_bytes=step_bytes)
                if step.checkpoint == step.start_offset:  # caught up
                    break
                steps += 1
            event(f"hours: {'<10' if len(store.hours_with_messages()) < 10 else '>=10'}")
            try:
                check(store, records, deliver_ats)
            finally:
                store.close()


def check(store: ScheduleStore, records: list[bytes], deliver_ats: list[int]) -> None:
    expected: dict[int, list[tuple[int, bytes]]] = {}
    for record, at in zip(records, deliver_ats):
        at = at if at > 0 else NOW
        expected.setdefault(at // HOUR_MS, []).append((at % HOUR_MS, record))
    assert store.hours_with_messages() == sorted(expected)
    for hour, wanted in expected.items():
        assert parse_hour_name(hour_name(hour)) == hour
        with store.open_hour(hour) as reader:
            heads = reader.heads()
            assert heads.entries == reader.entries == len(wanted)
            found: list[tuple[int, int]] = []
            for second in heads.seconds():
                chain = reader.chain(second)
                assert len(chain) == heads.counts[second]
                assert all(ms // 1000 == second for ms, _ in chain)
                found.extend(chain)
            assert sorted(e for _, e in found) == list(range(len(wanted)))
            by_entry = dict((e, ms) for ms, e in found)
            assert [by_entry[e] for e in range(len(wanted))] == [ms for ms, _ in wanted]
            assert reader.read_records(list(range(len(wanted)))) == [record for _, record in wanted]
