"""DispatchRecords: the master's dispatch records on a slave (scheduler/replica.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from delaymq.replication.membership import MEMBER_FILE, member_identity
from delaymq.scheduler.replica import DispatchRecords, decode_record, dispatch_record, finished_record
from delaymq.storage.state import StateStore


class SlowStore:
    """A schedule store whose hour 7 holds 10 entries and whose dispatch-log writes take a while."""

    def __init__(self) -> None:
        self.recorded: list[int] = []

    def entries(self, hour: int) -> int:
        return 10 if hour == 7 else 0

    def record_dispatched(self, hour: int, ready: list[int]) -> int:
        time.sleep(0.01)
        self.recorded.extend(ready)
        return len(ready)

    def flush_dispatched(self) -> None:
        pass


def test_records_round_trip_and_a_finished_hour_means_its_first_n() -> None:
    assert list(decode_record(dispatch_record(7, [3, 1, 2]))[1]) == [3, 1, 2]
    assert decode_record(finished_record(7, 4)) == (7, range(4))
    with pytest.raises(ValueError, match="malformed"):
        decode_record(dispatch_record(7, [1])[:-1])


def test_entries_not_filed_yet_are_held_until_replay_files_them_then_dropped_on_promotion() -> None:
    store = SlowStore()
    records = DispatchRecords(store)  # type: ignore[arg-type]
    assert records.take([dispatch_record(7, [1, 2, 12]), dispatch_record(8, [0])]) == 2
    assert sorted(store.recorded) == [1, 2] and records.held == 2
    assert records.drop() == 2 and records.held == 0


def settle_from_two_threads() -> tuple[SlowStore, DispatchRecords, list[BaseException]]:
    store = SlowStore()
    records = DispatchRecords(store)  # type: ignore[arg-type]
    records.take([dispatch_record(7, [11])])  # held: hour 7 has 10 entries
    errors: list[BaseException] = []

    def run(work: Callable[[], object]) -> None:
        try:
            work()
        except BaseException as error:
            errors.append(error)

    threads = [
        threading.Thread(target=run, args=(lambda: records.take([dispatch_record(7, [1, 2, 3])]),)),
        threading.Thread(target=run, args=(lambda: records.settle([7]),)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return store, records, errors


def test_the_journal_and_the_replay_loop_may_settle_the_same_hour_from_two_threads() -> None:
    for _ in range(20):
        store, records, errors = settle_from_two_threads()
        assert errors == []
        assert sorted(store.recorded) == [1, 2, 3] and records.held == 1


def test_a_data_folder_keeps_its_member_id_and_a_copy_without_the_file_gets_a_new_one(tmp_path: Path) -> None:
    with StateStore.open(tmp_path / "state") as state:
        _history, first = member_identity(tmp_path, state)
        assert member_identity(tmp_path, state)[1] == first  # kept across restarts
        (tmp_path / MEMBER_FILE).unlink()  # what the docs tell an operator to do with a copied folder
        assert member_identity(tmp_path, state)[1] != first
