"""A restart reads only what no commit vouches for: hours whose files end where their
committed summary says are not opened, and the last journal is written again only
where a heads table lacks it, without giving up its durability.

The crash is real: replay runs in a child process that dies right after a step's
schedule files are written and fsynced, before its lmdb commit.
"""

from __future__ import annotations

import os
import subprocess
import sys
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from delaymq.protocol.records import encode_message
from delaymq.scheduler.delayindex import JOURNAL_KEY, REPLAY_DB, unpack_journal
from delaymq.scheduler.hours import HOUR_MS
from delaymq.scheduler.replay import replay_step, replay_until_caught_up
from delaymq.scheduler.schedulelog import HEADS_SUFFIX
from delaymq.storage.log import SegmentedLog
from delaymq.storage.state import StateStore

BASE = 1_750_000_000_000 - 1_750_000_000_000 % HOUR_MS
HOUR = BASE // HOUR_MS
WIDE = 40  # hours the first step files into
NARROW = 3  # hours the step that dies files into


def records_for(hours: int, count: int, tag: str) -> list[bytes]:
    return [
        encode_message(
            f"{tag}{i}", "orders", deliver_at=BASE + (i % hours) * HOUR_MS + (i * 997) % 50_000, created_at=BASE
        )
        for i in range(count)
    ]


def write_log(root: Path, *batches: list[bytes]) -> list[int]:
    """Each batch appended whole; returns the offset after each."""
    ends = []
    with SegmentedLog.open(root / "messages") as log:
        for batch in batches:
            log.append(b"".join(batch))
            ends.append(log.end_offset)
    return ends


CHILD = """
import os, sys
from delaymq.storage.log import SegmentedLog
from delaymq.storage.state import StateStore
from delaymq.scheduler.schedulelog import ScheduleStore
from delaymq.scheduler.replay import replay_step

root, first_step = sys.argv[1], int(sys.argv[2])
log = SegmentedLog.open(root + "/messages")
state = StateStore.open(root + "/state")
store = ScheduleStore.open(root + "/schedule", state)
replay_step(log, store, max_bytes=first_step)
StateStore.write = lambda self: os._exit(17)  # killed after the files of the next step are fsynced
replay_step(log, store)
"""


@pytest.fixture
def opened(sched: SimpleNamespace) -> Any:
    return partial(sched.folder)


def test_an_open_checks_only_the_hours_a_crash_left_past_their_commit(tmp_path: Path, opened: Any) -> None:
    wide, narrow = records_for(WIDE, 400, "w"), records_for(NARROW, 60, "n")
    first_end, _end = write_log(tmp_path, wide, narrow)
    child = subprocess.run(
        [sys.executable, "-P", "-c", CHILD, str(tmp_path), str(first_end)], capture_output=True, timeout=120
    )
    assert child.returncode == 17, child.stderr.decode()
    with opened(tmp_path) as (log, store):
        stats = store.statistics()
        assert store.checkpoint == first_end  # the second step was not committed...
        assert stats.checked_hours == NARROW  # ...and only the hours it wrote were read again
        assert stats.recovered_hours == NARROW  # their entries past the commit kept (rolled forward)
        step = replay_until_caught_up(log, store)
        assert step.filed == 0 and step.already_filed == len(narrow)  # nothing filed twice
        assert sum(store.entries(HOUR + h) for h in range(WIDE)) == len(wide) + len(narrow)
    # Opened again after a clean close: nothing to read at all.
    with opened(tmp_path) as (log, store):
        assert store.statistics().checked_hours == 0


def test_a_vouched_hour_cut_short_is_still_found_and_refiled(tmp_path: Path, opened: Any) -> None:
    wide = records_for(WIDE, 400, "w")
    write_log(tmp_path, wide)
    with opened(tmp_path) as (log, store):
        replay_until_caught_up(log, store)
        checkpoint = store.checkpoint
        index = store.path_of(HOUR + 7, ".index")
        entries = store.entries(HOUR + 7)
    os.truncate(index, index.stat().st_size - 32)  # its last committed entry lost
    with opened(tmp_path) as (log, store):
        assert store.statistics().checked_hours == 1
        assert store.entries(HOUR + 7) == entries - 1
        assert store.checkpoint < checkpoint
        assert replay_until_caught_up(log, store).filed == 1
        assert store.entries(HOUR + 7) == entries


def test_the_journal_written_again_at_open_is_durable_before_the_next_commit_replaces_it(
    tmp_path: Path, opened: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, more = records_for(NARROW, 60, "a"), records_for(NARROW, 30, "b")
    first_end, _ = write_log(tmp_path, first, more)
    with opened(tmp_path) as (log, store):
        replay_step(log, store, max_bytes=first_end)  # committed; its journal names the hours' slots
        journal = unpack_journal(store.state.get(REPLAY_DB, JOURNAL_KEY) or b"")
    journal_hours = {key >> 12 for key in journal}
    assert journal_hours == {HOUR + h for h in range(NARROW)}

    # What reaches the disk, in order: the fdatasyncs of heads tables and the lmdb commits.
    events: list[str] = []
    real_fdatasync, real_write = os.fdatasync, StateStore.write

    def fdatasync(fd: int) -> None:
        events.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fdatasync(fd)

    def write(self: StateStore) -> Any:
        events.append("commit")
        return real_write(self)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    monkeypatch.setattr(StateStore, "write", write)
    monkeypatch.setattr("delaymq.scheduler.schedulefiles.syncfs", None)  # one fdatasync per file, to see them
    with opened(tmp_path) as (log, store):
        assert store.statistics().redone_slots == 0  # the tables already held the journal: nothing written
        assert not [e for e in events if e.endswith(HEADS_SUFFIX)]  # nor synced at open
        events.clear()
        replay_until_caught_up(log, store)  # the next commit replaces the journal
        commit = events.index("commit")
        synced_before = {e for e in events[:commit] if e.endswith(HEADS_SUFFIX)}
        assert {str(store.path_of(hour, HEADS_SUFFIX)) for hour in journal_hours} <= synced_before


def test_a_store_knows_without_a_stat_which_hours_have_delivered_nothing(tmp_path: Path, opened: Any) -> None:
    write_log(tmp_path, records_for(WIDE, 200, "w"))
    with opened(tmp_path) as (log, store):
        replay_until_caught_up(log, store)
        store.record_dispatched(HOUR + 1, range(3))
        store.flush_dispatched()
    with opened(tmp_path) as (log, store):
        real_exists = Path.exists
        asked: list[Path] = []

        def exists(self: Path, **kwargs: Any) -> bool:
            asked.append(self)
            return real_exists(self, **kwargs)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(Path, "exists", exists)
            pending = {hour: store.pending(hour) for hour in store.hours_with_messages()}
        assert pending[HOUR + 1] == store.entries(HOUR + 1) - 3
        assert sum(pending.values()) == 200 - 3
        assert len(asked) <= 1  # at most the one hour with a dispatch log was looked for, not each of 40
