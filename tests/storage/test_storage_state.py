"""StateStore: named dbs, batched writes, reopen, a growing map, format checks."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from delaymq.protocol.records import new_message_id
from delaymq.storage.errors import (
    DirectoryLocked,
    FormatMismatch,
    StateStoreError,
    StoreClosed,
)
from delaymq.storage.format import read_format, write_format
from delaymq.storage.log import SegmentedLog
from delaymq.storage.state import StateStore, absent_runs_skipped, pack, unpack


def test_values_survive_a_reopen(tmp_path: Path) -> None:
    with StateStore.open(tmp_path) as store:
        store.put("checkpoints", b"replay", b"\x00\x00\x10\x00")
        with store.write() as batch:
            batch.put("positions", b"group-a/consumer-1", pack({"acked": 17}))
            batch.put("positions", b"group-a/consumer-2", pack({"acked": 3}))
            batch.put("positions", b"group-b/consumer-1", pack({"acked": 99}))
            batch.put("checkpoints", b"doomed", b"x")
            batch.delete("checkpoints", b"doomed")
    with StateStore.open(tmp_path) as store:
        assert store.get("checkpoints", b"replay") == b"\x00\x00\x10\x00"
        assert store.get("checkpoints", b"doomed") is None
        assert store.get("never-written", b"k") is None
        group_a = store.items("positions", prefix=b"group-a/")
        assert [(k, unpack(v)) for k, v in group_a] == [
            (b"group-a/consumer-1", {"acked": 17}),
            (b"group-a/consumer-2", {"acked": 3}),
        ]
        assert len(store.items("positions")) == 3
        assert store.get_many("positions", [b"group-b/consumer-1", b"absent", b"group-a/consumer-2"]) == [
            pack({"acked": 99}),
            None,
            pack({"acked": 3}),
        ]
        assert store.items("positions", prefix=b"group-z") == []
        store.delete("positions", b"group-b/consumer-1")
        assert store.get("positions", b"group-b/consumer-1") is None


def test_a_batch_sees_its_own_writes_and_is_dropped_if_its_block_fails(tmp_path: Path) -> None:
    with StateStore.open(tmp_path) as store:
        store.put("db", b"a", b"1")
        with pytest.raises(RuntimeError):
            with store.write() as batch:
                batch.put("db", b"a", b"2")
                assert batch.get("db", b"a") == b"2"
                batch.delete("db", b"a")
                assert batch.get("db", b"a") is None
                raise RuntimeError("abandon")
        assert store.get("db", b"a") == b"1"


def test_the_map_grows_past_its_initial_size(tmp_path: Path) -> None:
    initial = 1 << 20
    value = bytes(range(256)) * 256  # 64 KiB
    with StateStore.open(tmp_path, map_size=initial) as store:
        with store.write() as batch:  # one transaction bigger than the whole map
            for i in range(40):
                batch.put("blobs", b"batch-%03d" % i, value)
        for i in range(40):
            store.put("blobs", b"single-%03d" % i, value)
        assert store.resizes >= 2
        assert store.map_size >= 4 * initial
    with StateStore.open(tmp_path, map_size=initial) as store:
        assert len(store.items("blobs")) == 80
        assert store.get("blobs", b"batch-039") == value


def test_growing_is_capped_by_max_map_size(tmp_path: Path) -> None:
    with StateStore.open(tmp_path, map_size=1 << 20, max_map_size=2 << 20) as store:
        with pytest.raises(StateStoreError, match=r"map size 2097152 bytes has reached max_map_size"):
            for i in range(100):
                store.put("blobs", b"%03d" % i, bytes(64 << 10))


def test_readers_in_other_threads_during_growth(tmp_path: Path) -> None:
    with StateStore.open(tmp_path, map_size=1 << 20) as store:
        store.put("db", b"stable", b"value")
        stop = threading.Event()
        seen: list[bytes | None] = []

        def reader() -> None:
            while not stop.is_set():
                seen.append(store.get("db", b"stable"))

        thread = threading.Thread(target=reader)
        thread.start()
        try:
            for i in range(60):
                store.put("big", b"%03d" % i, bytes(64 << 10))
        finally:
            stop.set()
            thread.join()
        assert store.resizes >= 2
        assert seen and set(seen) == {b"value"}


async def test_called_from_trio_through_threads(tmp_path: Path) -> None:
    store = await trio.to_thread.run_sync(StateStore.open, tmp_path)
    try:
        await trio.to_thread.run_sync(store.put, "db", b"k", b"v")
        assert await trio.to_thread.run_sync(store.get, "db", b"k") == b"v"
    finally:
        store.close()


def test_a_batch_applies_its_puts_and_deletes_in_the_order_given(tmp_path: Path) -> None:
    with StateStore.open(tmp_path) as store:
        store.put("a", b"gone", b"0")
        with store.write() as batch:
            batch.put_many("a", [(b"k1", b"1"), (b"k2", b"1")])
            batch.put("b", b"k1", b"b1")
            batch.put_many("b", [[b"k2", b"b2"]])  # pairs as lists (msgpack decodes them so)
            batch.delete("a", b"k1")  # after its put: deleted
            batch.delete("a", b"gone")
            batch.put_many("a", [(b"gone", b"back")])  # after its delete: put
            batch.put_many("a", [])
            batch.put("a", b"k2", b"2")  # the later put wins
            assert len(batch) == 8
            assert batch.get("a", b"k1") is None and batch.get("a", b"gone") == b"back"
        assert store.items("a") == [(b"gone", b"back"), (b"k2", b"2")]
        assert store.items("b") == [(b"k1", b"b1"), (b"k2", b"b2")]


def test_a_batch_with_one_key_outside_lmdb_limits_writes_nothing(tmp_path: Path) -> None:
    with StateStore.open(tmp_path) as store:
        with pytest.raises(StateStoreError, match=r"key of 600 bytes for db 'db'"):
            with store.write() as batch:
                batch.put("db", b"first", b"v")
                batch.put_many("db", [(b"ok", b"v"), (bytes(600), b"v")])
        assert store.items("db") == []


def test_keys_outside_lmdb_limits_are_refused_by_size(tmp_path: Path) -> None:
    with StateStore.open(tmp_path) as store:
        with pytest.raises(StateStoreError, match=r"key of 600 bytes for db 'db' .* \(1 to 511 bytes\)"):
            store.put("db", bytes(600), b"v")
        with pytest.raises(StateStoreError, match="key of 0 bytes"):
            store.put("db", b"", b"v")


def test_mismatched_format_parameters_are_refused_naming_them(tmp_path: Path) -> None:
    with StateStore.open(tmp_path, extra_format={"heads_entry_version": 1}) as store:
        store.put("db", b"k", b"v")
    with pytest.raises(FormatMismatch, match="heads_entry_version: stored 1, requested 2"):
        StateStore.open(tmp_path, extra_format={"heads_entry_version": 2})
    stored = read_format(tmp_path)
    assert stored is not None
    write_format(tmp_path, {**stored, "version": 99})
    with pytest.raises(FormatMismatch, match="version: stored 99, requested 1"):
        StateStore.open(tmp_path, extra_format={"heads_entry_version": 1})


def test_a_log_folder_is_not_taken_for_a_state_store(tmp_path: Path) -> None:
    SegmentedLog.open(tmp_path, segment_size=4096).close()
    with pytest.raises(FormatMismatch, match="format: stored 'segmented-log', requested 'lmdb-state'"):
        StateStore.open(tmp_path)


def test_one_store_per_folder_and_none_after_close(tmp_path: Path) -> None:
    store = StateStore.open(tmp_path)
    with pytest.raises(DirectoryLocked):
        StateStore.open(tmp_path)
    store.close()
    with pytest.raises(StoreClosed):
        store.get("db", b"k")


_OPEN_DB_WHILE_WRITING = """
import sys, threading, time
from pathlib import Path
from delaymq.storage.state import StateStore

store = StateStore.open(Path(sys.argv[1]))
started = threading.Event()

def writer():
    with store._env.begin(write=True) as txn:  # a write transaction, as another thread's put holds one
        started.set()
        for i in range(200):  # Python work inside it: the thread needs the GIL again and again
            txn.put(b"k%d" % i, b"v")
            time.sleep(0.001)

thread = threading.Thread(target=writer)
thread.start()
started.wait()
store.put("a_new_db", b"key", b"value")  # opens a named db while the writer holds lmdb's writer lock
thread.join()
print(store.get("a_new_db", b"key").decode())
"""


def test_opening_a_named_db_while_another_thread_writes_does_not_hang_the_process(tmp_path: Path) -> None:
    """py-lmdb's open_db without a transaction begins one holding the GIL: with another thread
    in a write transaction waiting for the GIL, the whole process froze (a realtime member's
    STATUS and fetcher threads did, now and then, at start-up)."""
    done = subprocess.run(
        [sys.executable, "-c", _OPEN_DB_WHILE_WRITING, str(tmp_path / "state")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONSAFEPATH": "1"},
    )
    assert (done.returncode, done.stdout.strip()) == (0, "value"), done.stderr


class _CountingCursor:
    """A cursor that counts its ``set_range`` calls (each one releases the GIL in lmdb)."""

    def __init__(self, cursor: Any) -> None:
        self._cursor = cursor
        self.calls = 0

    def set_range(self, key: bytes) -> bool:
        self.calls += 1
        return bool(self._cursor.set_range(key))

    def key(self) -> bytes:
        return bytes(self._cursor.key())

    def value(self) -> bytes:
        return bytes(self._cursor.value())


_short_keys = st.binary(min_size=1, max_size=3)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stored=st.sets(_short_keys, max_size=40), wanted=st.lists(_short_keys, max_size=40))
def test_get_many_answers_as_one_get_per_key_does(tmp_path: Path, stored: set[bytes], wanted: list[bytes]) -> None:
    # Many keys go through one cursor that skips runs of absent keys: same answers, in
    # the order asked, duplicates and memoryviews included.
    folder = tmp_path / os.urandom(4).hex()
    with StateStore.open(folder) as store:
        with store.write() as batch:
            for key in stored:
                batch.put("ids", key, b"v" + key)
        asked: list[bytes | memoryview] = [memoryview(k) if i % 3 == 0 else k for i, k in enumerate(wanted)]
        assert store.get_many("ids", asked) == [b"v" + k if k in stored else None for k in wanted]
        assert [store.get("ids", k) for k in wanted] == [b"v" + k if k in stored else None for k in wanted]


def test_new_time_ordered_ids_cost_one_cursor_call_for_the_batch(tmp_path: Path) -> None:
    # Ids made now sort after every id stored before: the batch is known absent in one call,
    # where one lmdb call per key would give up the GIL a thousand times.
    older = [new_message_id(1_000 + i // 100).encode() for i in range(2_000)]
    newer = [new_message_id(9_000 + i // 100).encode() for i in range(1_000)]
    with StateStore.open(tmp_path) as store:
        with store.write() as batch:
            for key in older:
                batch.put("ids", key, b"v")
        env = store._env
        with env.begin(db=store._handle("ids"), buffers=False) as txn:
            cursor = _CountingCursor(txn.cursor())
            assert absent_runs_skipped(cursor, sorted(newer)) == {}
            assert cursor.calls == 1
            cursor = _CountingCursor(txn.cursor())
            mixed = sorted([*newer, older[5], older[1_500]])
            assert absent_runs_skipped(cursor, mixed) == {older[5]: b"v", older[1_500]: b"v"}
            assert cursor.calls == 3  # the first stored one, the second, then past the end
        assert store.get_many("ids", [*newer[:10], older[7]]) == [None] * 10 + [b"v"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    before=st.sets(_short_keys, max_size=20),
    writes=st.lists(st.tuples(st.booleans(), st.lists(_short_keys, min_size=1, max_size=5)), max_size=10),
)
def test_the_highest_key_kept_is_never_below_a_stored_key(
    tmp_path: Path, before: set[bytes], writes: list[tuple[bool, list[bytes]]]
) -> None:
    # What was stored before ``keep_highest_key`` (a reopen) is read; every write after it
    # raises the bound before it commits, deletes included in the mix (they never lower it).
    folder = tmp_path / os.urandom(4).hex()
    with StateStore.open(folder) as store:
        with store.write() as batch:
            for key in before:
                batch.put("ids", key, b"v")
    with StateStore.open(folder) as store:
        store.keep_highest_key("ids")
        assert store.highest_key("ids") == max(before, default=b"")
        for deleting, keys in writes:
            with store.write() as batch:
                for key in keys:
                    if deleting:
                        batch.delete("ids", key)
                    else:
                        batch.put("ids", key, b"v")
            stored = [key for key, _ in store.items("ids")]
            assert all(key <= store.highest_key("ids") for key in stored)
        assert store.highest_key("ids") == max([*before, *(k for d, ks in writes if not d for k in ks)], default=b"")
