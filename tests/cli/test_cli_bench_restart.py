"""``delaymq bench restart`` builds its backlog with the storage code: a folder a scheduler opens as its own."""

from __future__ import annotations

from pathlib import Path

from delaymq.bench.restart import build_backlog
from delaymq.scheduler.hours import HOUR_MS
from delaymq.scheduler.schedulelog import ScheduleStore
from delaymq.storage.log import SegmentedLog
from delaymq.storage.state import StateStore

NOW = 1_750_000_000_000


def test_the_built_folder_holds_every_message_filed_into_its_hour(tmp_path: Path) -> None:
    build_backlog(tmp_path, 3_000, now_ms=NOW, spread_ms=5 * HOUR_MS)
    with (
        SegmentedLog.open(tmp_path / "messages") as log,
        StateStore.open(tmp_path / "state", extra_format={"scheduler_state": 1}) as state,
        ScheduleStore.open(tmp_path / "schedule", state) as store,
    ):
        assert store.checkpoint == log.end_offset  # all of it filed
        hours = store.hours_with_messages()
        assert hours[0] >= (NOW + 60_000) // HOUR_MS and hours[-1] <= (NOW + 60_000 + 5 * HOUR_MS) // HOUR_MS
        assert sum(store.pending(hour) for hour in hours) == 3_000
        assert store.statistics().checked_hours == 0  # nothing left past a commit
