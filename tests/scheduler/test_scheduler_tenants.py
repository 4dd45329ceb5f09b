"""Duplicates are decided per (subject, id): a producer that learns another tenant's
message id cannot get that message dropped or its own answered ``duplicate``.

A model test drives the real duplicate decision (``fresh_records`` over the unfiled
tail and ``look_up_fresh`` over the index), the real filing and the real message log
against a reference set of (subject, id) pairs scheduled and not delivered; then a
slave's filing of the same log, in other steps, must give the same index. The
end-to-end tests run a real scheduler and realtime server (``conftest.py``) under
``autojump_clock`` (docs/cancel.md).
"""

from __future__ import annotations

import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from delaymq.protocol.commands import Command
from delaymq.protocol.envelope import HEADER_SIZE
from delaymq.protocol.records import encode_message, redeliver_at, scan_batch
from delaymq.scheduler import roles
from delaymq.scheduler.cancels import ScheduledBatch, Tail, fresh_records, look_up_fresh
from delaymq.scheduler.cutback import cut_schedule_folder
from delaymq.scheduler.delayindex import ENTRY, ENTRY_SIZE
from delaymq.scheduler.hours import HOUR_MS
from delaymq.scheduler.idcutback import drop_from
from delaymq.scheduler.idindex import (
    CANCELLED,
    CANCELLED_DB,
    DISPLACED_DB,
    IDS_DB,
    KEYS_DB,
    SCHEDULED,
    cancel_record,
    displaced_key,
    filed_records,
    ids_for_key,
    index_key,
    lookup,
    move_record,
)
from delaymq.scheduler.replay import replay_step, replay_until_caught_up
from delaymq.scheduler.schedule import index_keys
from delaymq.scheduler.schedulelog import INDEX_SUFFIX, ScheduleStore
from delaymq.scheduler.staging import ReplayStep
from delaymq.storage.log import SegmentedLog
from delaymq.storage.state import StateStore

from .conftest import QUIET

NOW = 1_749_996_000_000  # an hour boundary
SECOND = 1_000
INDEX_DBS = (IDS_DB, DISPLACED_DB, KEYS_DB, CANCELLED_DB)


def record(subject: str, message_id: str, at: int, key: str | None = None, attempts: int = 0) -> bytes:
    properties = {"key": key} if key else None
    return encode_message(
        message_id,
        subject,
        body=f"{subject}/{message_id}".encode(),
        deliver_at=at,
        created_at=NOW,
        properties=properties,
        attempts=attempts,
    )


class Folder:
    """A message log, lmdb state and schedule store in ``root``."""

    def __init__(self, root: Path) -> None:
        self.log = SegmentedLog.open(root / "messages")
        self.state = StateStore.open(root / "state")
        self.store = ScheduleStore.open(root / "schedule", self.state)

    def index(self) -> dict[str, list[tuple[bytes, bytes]]]:
        return {db: self.state.items(db) for db in INDEX_DBS}

    def close(self) -> None:
        self.store.close()
        self.state.close()
        self.log.close()


class Master(Folder):
    """What a master does on SCHEDULE, without the server around it: decide with the real
    functions, append what is new, tell the tail; ``file`` runs a replay step."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.tail = Tail()
        self.sources: dict[int, tuple[str, str]] = {}  # message-log offset -> (subject, id)
        self.batch_ends: dict[int, int] = {}  # message-log offset -> where its SCHEDULE's records end
        self.latest: dict[tuple[str, str], int] = {}  # (subject, id) -> offset of its latest record

    def schedule(self, records: list[bytes]) -> list[bool]:
        batch = scan_batch(b"".join(records))
        keys, hashes = index_keys(batch)
        checkpoint = self.store.checkpoint
        found = None if self.store.past_every_indexed(keys) else look_up_fresh(self.store, keys, batch.subjects)
        fresh, overlap = fresh_records(self.tail, keys, batch.subjects, found, checkpoint)
        kept = [i for i, new in enumerate(fresh) if new]
        if kept:
            data = b"".join(records[i] for i in kept)
            offset = self.log.append(data)
            self.log.flush()
            position = offset
            for i in kept:
                self.sources[position] = (batch.subjects[i], batch.ids[i])
                self.batch_ends[position] = offset + len(data)
                self.latest[(batch.subjects[i], batch.ids[i])] = position
                position += len(records[i])
            appended = ScheduledBatch(
                [keys[i] for i in kept], [batch.deliver_ats[i] for i in kept], [hashes[i] for i in kept], kept,
                batch.starts, batch.ends, offset, offset + len(data), [batch.subjects[i] for i in kept],
            )  # fmt: skip
            self.tail.add(appended, offset + len(data), overlap=overlap)
        return fresh

    def file(self, max_bytes: int) -> None:
        replay_step(self.log, self.store, max_bytes=max_bytes)
        self.tail.filed(self.store.checkpoint)

    def filed_entries(self) -> dict[tuple[str, str], tuple[int, int]]:
        """(subject, id) -> (hour, entry) of its latest message, once its whole SCHEDULE is filed
        (until then the tail answers for the batch: a message delivered meanwhile is still a
        duplicate)."""
        found: dict[tuple[str, str], tuple[int, int]] = {}
        for hour in self.store.hours_with_messages():
            raw = self.store.path_of(hour, INDEX_SUFFIX).read_bytes()[: self.store.entries(hour) * ENTRY_SIZE]
            for entry, fields in enumerate(ENTRY.iter_unpack(raw)):
                source = fields[4]
                pair = self.sources[source]
                if self.latest[pair] == source and self.batch_ends[source] <= self.store.checkpoint:
                    found[pair] = (hour, entry)
        return found


SUBJECTS = ("tenant-a.orders", "tenant-b.orders", "tenant-c.orders")
message_specs = st.tuples(
    st.sampled_from(SUBJECTS),
    st.sampled_from(("x", "y")),
    st.sampled_from((NOW + 10 * SECOND, NOW + HOUR_MS + 5 * SECOND)),
    st.sampled_from((None, "k1")),
)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("schedule"), st.lists(message_specs, min_size=1, max_size=4)),
        st.tuples(st.just("file"), st.sampled_from((1, 400, 1 << 20))),
        st.tuples(st.just("deliver"), st.integers(0, 10)),
    ),
    max_size=30,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations)
def test_a_schedule_is_a_duplicate_exactly_when_its_subject_and_id_are_pending(ops: list[Any]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        master = Master(root / "master")
        try:
            pending: set[tuple[str, str]] = set()  # the reference: scheduled, not delivered
            for op, arg in ops:
                if op == "schedule":
                    fresh = master.schedule([record(s, i, at, key) for s, i, at, key in arg])
                    seen: set[tuple[str, str]] = set()
                    expected = []
                    for subject, message_id, _at, _key in arg:
                        expected.append((subject, message_id) not in pending | seen)
                        seen.add((subject, message_id))
                    assert fresh == expected, (arg, sorted(pending))
                    pending |= seen
                elif op == "file":
                    master.file(arg)
                else:
                    filed = master.filed_entries()
                    deliverable = sorted(pair for pair in pending if pair in filed)
                    if deliverable:
                        pair = deliverable[arg % len(deliverable)]
                        hour, entry = filed[pair]
                        master.store.record_dispatched(hour, [entry])
                        pending.discard(pair)
            replay_until_caught_up(master.log, master.store)
            # A slave files the same log with the same code, in steps of one record.
            slave = Folder(root / "slave")
            try:
                offset = 0
                while offset < master.log.end_offset:  # the same bytes at the same offsets, as fetched
                    data, offset = master.log.read_raw(offset, 1 << 20)
                    slave.log.append(data)
                slave.log.flush()
                while not replay_step(slave.log, slave.store, max_bytes=1).idle:
                    pass
                assert slave.index() == master.index()
            finally:
                slave.close()
        finally:
            master.close()


def test_filing_moves_the_older_tenants_message_to_its_displaced_key_and_a_restart_keeps_it(
    tmp_path: Path,
) -> None:
    master = Master(tmp_path)
    try:
        b_first = record("tenant-b.orders", "x", NOW + 10 * SECOND, key="order-1")
        a_later = record("tenant-a.orders", "x", NOW + 20 * SECOND)
        assert master.schedule([b_first]) == [True]
        master.file(1 << 20)
        assert master.schedule([a_later]) == [True]
        master.file(1 << 20)
        # Retries of both, answered from the index: each is its own tenant's duplicate.
        assert master.schedule([a_later, b_first]) == [False, False]
        displaced = master.state.items(DISPLACED_DB)
        assert [key.split(b"\x00")[0] for key, _value in displaced] == [b"x"]
    finally:
        master.close()
    reopened = Master(tmp_path)
    try:
        assert reopened.schedule([a_later, b_first]) == [False, False]
        assert reopened.schedule([record("tenant-c.orders", "x", NOW + 30 * SECOND)]) == [True]
    finally:
        reopened.close()


class Crash(Exception):
    pass


def test_entries_rolled_forward_after_a_crash_are_indexed_as_filing_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed between writing a step's files and its commit: recovery keeps the entries and
    indexes them (ids taken from other subjects included) as the step would have."""
    records = [
        record(SUBJECTS[i % 3], f"id-{i % 7}", NOW + (i % 2) * HOUR_MS + i * SECOND, key="k" if i % 5 == 0 else None)
        for i in range(60)
    ]
    crashed = Master(tmp_path / "crashed")
    clean = Master(tmp_path / "clean")
    try:
        for folder in (crashed, clean):
            folder.log.append(b"".join(records[:30]))
            folder.log.append(b"".join(records[30:]))
            folder.log.flush()
        replay_step(crashed.log, crashed.store, max_bytes=2_000)
        with monkeypatch.context() as patched:
            patched.setattr(StateStore, "write", lambda self: (_ for _ in ()).throw(Crash()))
            patched.setattr(ScheduleStore, "_abort", lambda self: self._clear_step())  # a dead process cleans nothing
            with pytest.raises(Crash):
                replay_step(crashed.log, crashed.store, max_bytes=1 << 20)
        replay_until_caught_up(clean.log, clean.store)
    finally:
        clean.close()
        crashed.close()
    crashed, clean = Master(tmp_path / "crashed"), Master(tmp_path / "clean")
    try:
        assert crashed.store.statistics().recovered_hours >= 1
        replay_until_caught_up(crashed.log, crashed.store)
        assert crashed.index() == clean.index()
        assert crashed.index()[DISPLACED_DB]
    finally:
        clean.close()
        crashed.close()


# ------------------------------------------------------------------ end to end

TENANT_A, TENANT_B = "tenant-a.orders", "tenant-b.orders"


async def schedule(cluster: Any, *records: bytes) -> list[str]:
    frame = await cluster.schedule_raw(list(records))
    results: list[str] = frame.metadata["results"]
    return results


async def call(cluster: Any, command: Command, metadata: dict[str, Any]) -> list[dict[str, Any]]:
    frame = await cluster.net.call(
        cluster.address if hasattr(cluster, "address") else "scheduler.test:1", command, metadata
    )
    results: list[dict[str, Any]] = frame.metadata["results"]
    return results


async def all_filed(scheduler: Any) -> None:
    """Until replay has filed the whole message log (each step sets a new ``step_filed``)."""
    while scheduler.store.checkpoint < scheduler.member.log.end_offset:
        await scheduler.session.step_filed.wait()


async def test_another_tenants_id_is_scheduled_and_both_are_delivered_at_their_time(
    sched: Any, tmp_path: Path, autojump_clock: Any
) -> None:
    async with sched.open_cluster(tmp_path, **QUIET) as cluster:
        now = cluster.clock.now_ms()
        a_receiver, b_receiver = cluster.receiver(TENANT_A), cluster.receiver(TENANT_B)
        b_at, a_at = now + 10 * SECOND, now + 20 * SECOND
        b_x, a_x = record(TENANT_B, "X", b_at), record(TENANT_A, "X", a_at)
        async with cluster.scheduler() as scheduler:
            assert await schedule(cluster, b_x) == ["scheduled"]
            assert await schedule(cluster, a_x) == ["scheduled"]
            assert await schedule(cluster, a_x) == ["duplicate"]  # a retry, not yet filed
            assert await schedule(cluster, b_x) == ["duplicate"]
            await all_filed(scheduler)  # the index answers now
            assert await schedule(cluster, a_x, b_x) == ["duplicate", "duplicate"]
            await a_receiver.wait_for(1)
            await b_receiver.wait_for(1)
            await cluster.clock.sleep_until_ms(a_at + 5 * SECOND)
            assert [(r.id, r.deliver_at) for r in b_receiver.got] == [("X", b_at)]
            assert [(r.id, r.deliver_at) for r in a_receiver.got] == [("X", a_at)]
            assert 0 <= b_receiver.got[0].received_at - b_at <= 2
            assert 0 <= a_receiver.got[0].received_at - a_at <= 2
            # Delivered: the same id may be scheduled again by either tenant.
            assert await schedule(cluster, record(TENANT_A, "X", now + 60 * SECOND)) == ["scheduled"]


async def test_by_id_the_newest_message_of_an_id_is_reached_by_key_each_tenants_own(
    sched: Any, tmp_path: Path, autojump_clock: Any
) -> None:
    async with sched.open_cluster(tmp_path, **QUIET) as cluster:
        now = cluster.clock.now_ms()
        a_receiver, b_receiver = cluster.receiver(TENANT_A), cluster.receiver(TENANT_B)
        async with cluster.scheduler() as scheduler:
            b_x = record(TENANT_B, "X", now + 30 * SECOND, key="order-7")
            a_x = record(TENANT_A, "X", now + 40 * SECOND, key="order-7")
            assert await schedule(cluster, b_x, a_x) == ["scheduled", "scheduled"]
            queried = await call(cluster, Command.QUERY, {"ids": ["X"]})
            assert [(q["id"], q["state"], q["deliver_at"]) for q in queried] == [("X", "scheduled", now + 40 * SECOND)]
            # By subject and key each tenant reaches its own message: B's is moved, A's stays.
            moved_to = now + 50 * SECOND
            moved = await call(cluster, Command.MOVE, {"subject": TENANT_B, "key": "order-7", "deliver_at": moved_to})
            assert [(m["id"], m["state"], m["deliver_at"]) for m in moved] == [("X", "moved", moved_to)]
            cancelled = await call(cluster, Command.CANCEL, {"subject": TENANT_A, "key": "order-7"})
            assert [(c["id"], c["state"]) for c in cancelled] == [("X", "cancelled")]
            await all_filed(scheduler)
            # The moved message filed the id last: by id it is B's now.
            queried = await call(cluster, Command.QUERY, {"ids": ["X"]})
            assert [(q["state"], q["deliver_at"]) for q in queried] == [("scheduled", moved_to)]
            assert await schedule(cluster, a_x) == ["scheduled"]  # A's was cancelled: new again
            assert await schedule(cluster, b_x) == ["duplicate"]
            await cluster.clock.sleep_until_ms(moved_to + 5 * SECOND)
            assert [(r.id, r.deliver_at) for r in b_receiver.got] == [("X", moved_to)]
            assert [(r.id, r.deliver_at) for r in a_receiver.got] == [("X", now + 40 * SECOND)]
            assert Counter(r.id for r in a_receiver.got + b_receiver.got) == {"X": 2}


async def test_a_cancel_by_key_right_after_another_tenant_took_the_id_cancels_its_own_message(
    sched: Any, tmp_path: Path, autojump_clock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tenant A's key names A's message under id X; B's X, accepted but not filed yet, will
    take the id when filed. A cancel by A's key that looked while B's record was unfiled
    must still cancel A's message, never B's."""
    held = trio.Event()  # filing waits (as a busy replay would) until this is set
    real_step = roles.replay_step

    def step_when_released(log: Any, store: ScheduleStore, **options: Any) -> ReplayStep:
        if not held.is_set():
            at = store.checkpoint
            return ReplayStep(start_offset=at, checkpoint=at, filed=0, already_filed=0, skipped=0, bytes=0)
        return real_step(log, store, **options)

    async with sched.open_cluster(tmp_path, **QUIET) as cluster:
        now = cluster.clock.now_ms()
        a_receiver, b_receiver = cluster.receiver(TENANT_A), cluster.receiver(TENANT_B)
        async with cluster.scheduler() as scheduler:
            assert await schedule(cluster, record(TENANT_A, "X", now + 30 * SECOND, key="order-7")) == ["scheduled"]
            await all_filed(scheduler)
            monkeypatch.setattr(roles, "replay_step", step_when_released)
            assert await schedule(cluster, record(TENANT_B, "X", now + 20 * SECOND)) == ["scheduled"]
            answers: list[list[dict[str, Any]]] = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    lambda: _append(answers, call(cluster, Command.CANCEL, {"subject": TENANT_A, "key": "order-7"}))
                )
                await trio.sleep(0.5)
                assert answers == []  # it waits for B's record to be filed
                held.set()
            assert [(c["id"], c["state"], c["deliver_at"]) for c in answers[0]] == [
                ("X", "cancelled", now + 30 * SECOND)
            ]
            queried = await call(cluster, Command.QUERY, {"subject": TENANT_A, "key": "order-7"})
            assert [(q["id"], q["state"]) for q in queried] == [("X", "cancelled")]
            await cluster.clock.sleep_until_ms(now + 35 * SECOND)
            assert [(r.id, r.deliver_at) for r in b_receiver.got] == [("X", now + 20 * SECOND)]
            assert a_receiver.got == []


async def _append(answers: list[Any], call: Any) -> None:
    answers.append(await call)


def test_cancel_and_move_records_of_displaced_messages_file_alike_in_any_steps(tmp_path: Path) -> None:
    """A slave's replay steps end elsewhere than its master's: a displacement and a CANCEL or
    MOVE of the displaced message may fall in one step or two, and file alike."""
    a, b, c = SUBJECTS
    b_x, a_x = record(b, "x", NOW + 10 * SECOND, key="k1"), record(a, "x", NOW + 20 * SECOND)
    c_x = record(c, "x", NOW + 30 * SECOND, key="k1")
    moved_to = NOW + HOUR_MS + SECOND
    log_records = [
        b_x,
        a_x,  # takes x: B's message is displaced
        cancel_record([displaced_key("x", b)], taken_at=NOW),
        c_x,  # takes x: A's message is displaced
        move_record([redeliver_at(a_x, moved_to)]),  # A's displaced message moves, and takes x again
    ]
    folders = {}
    for name, step in (("master", 1 << 20), ("slave", 1)):
        folder = folders[name] = Folder(tmp_path / name)
        for data in log_records:
            folder.log.append(data)
        folder.log.flush()
        while not replay_step(folder.log, folder.store, max_bytes=step).idle:
            pass
    try:
        master = folders["master"]
        assert master.index() == folders["slave"].index()
        [x_value, d_b, d_a, d_c] = lookup(
            master.state, ["x", displaced_key("x", b), displaced_key("x", a), displaced_key("x", c)]
        )
        assert x_value is not None and x_value.deliver_at == moved_to  # by id: the message filed last
        assert d_b is not None and d_b.state == CANCELLED
        assert d_a is not None and d_a.state == CANCELLED  # moved away from here
        assert d_c is not None and (d_c.state, d_c.deliver_at) == (SCHEDULED, NOW + 30 * SECOND)
        assert ids_for_key(master.state, c, "k1") == [displaced_key("x", c)]
        assert master.store.delivered(NOW // HOUR_MS) == {0, 1}  # B's and A's first entries are done
    finally:
        for folder in folders.values():
            folder.close()


def test_deleting_a_delivered_hour_forgets_its_displaced_messages_too(tmp_path: Path) -> None:
    a, b, _c = SUBJECTS
    folder = Folder(tmp_path)
    try:
        first_hour = NOW // HOUR_MS
        folder.log.append(record(b, "x", NOW + 10 * SECOND, key="k1") + record(a, "x", NOW + HOUR_MS + SECOND))
        folder.log.flush()
        replay_until_caught_up(folder.log, folder.store)
        assert ids_for_key(folder.state, b, "k1") == [displaced_key("x", b)]
        folder.store.record_dispatched(first_hour, [0])
        folder.store.delete_hour(first_hour)
        assert folder.state.items(DISPLACED_DB) == []
        assert folder.state.items(KEYS_DB) == []
        [x_value] = lookup(folder.state, ["x"])
        assert x_value is not None and x_value.deliver_at == NOW + HOUR_MS + SECOND
    finally:
        folder.close()


def test_a_cut_back_gives_an_id_back_to_the_message_the_cut_record_took_it_from(tmp_path: Path) -> None:
    """A slave cuts a filed tail its new master never had (async replication): an id a cut
    record took from another subject's message is that message's again, as on the master."""
    a, b, _c = SUBJECTS
    kept = record(b, "x", NOW + 10 * SECOND, key="k1")
    cut = record(a, "x", NOW + 20 * SECOND)
    slave, master = Folder(tmp_path / "slave"), Folder(tmp_path / "master")
    try:
        for folder, records in ((slave, [kept, cut]), (master, [kept])):
            for data in records:
                folder.log.append(data)
            folder.log.flush()
            replay_until_caught_up(folder.log, folder.store)
        assert slave.state.items(DISPLACED_DB) != []
        slave.store.close()
        cut_schedule_folder(tmp_path / "slave" / "schedule", len(kept))
        slave.log.truncate(len(kept))
        drop_from(slave.state, len(kept), tmp_path / "slave" / "schedule")
        slave.store = ScheduleStore.open(tmp_path / "slave" / "schedule", slave.state)
        assert slave.index() == master.index()
    finally:
        slave.close()
        master.close()


def cut_back(folder: Folder, root: Path, offset: int) -> None:
    """What a slave does with a filed tail its new master never had (``_cut`` in the server)."""
    folder.store.close()
    cut_schedule_folder(root / "schedule", offset)
    folder.log.truncate(offset)
    drop_from(folder.state, offset, root / "schedule")
    folder.store = ScheduleStore.open(root / "schedule", folder.state)


@pytest.mark.parametrize("change", ["cancel", "move"])
def test_a_cut_cancel_or_move_gives_the_message_filed_before_it_its_id_back(tmp_path: Path, change: str) -> None:
    """B's x, then A's x (B displaced), then a CANCEL or MOVE of x that the new master never
    had: cut, A's message holds x again, scheduled where it was, and B stays displaced."""
    a, b, _c = SUBJECTS
    b_x, a_x = record(b, "x", NOW + 10 * SECOND), record(a, "x", NOW + 20 * SECOND)
    kept = b_x + a_x
    cut = cancel_record(["x"], taken_at=NOW) if change == "cancel" else move_record([redeliver_at(a_x, NOW + HOUR_MS)])
    slave, master = Folder(tmp_path / "slave"), Folder(tmp_path / "master")
    try:
        for folder, records in ((slave, [kept, cut]), (master, [kept])):
            for data in records:
                folder.log.append(data)
            folder.log.flush()
            replay_until_caught_up(folder.log, folder.store)
        cut_back(slave, tmp_path / "slave", len(kept))
        assert slave.index() == master.index()
        [x_value, b_value] = lookup(slave.state, ["x", displaced_key("x", b)])
        assert x_value is not None and (x_value.state, x_value.deliver_at) == (SCHEDULED, NOW + 20 * SECOND)
        assert b_value is not None and (b_value.state, b_value.deliver_at) == (SCHEDULED, NOW + 10 * SECOND)
        assert slave.store.cancelled(NOW // HOUR_MS) == []
    finally:
        slave.close()
        master.close()
    again = Master(tmp_path / "slave")
    try:  # retries of both are each their tenant's duplicate, as on the master
        assert again.schedule([a_x, b_x]) == [False, False]
    finally:
        again.close()


KEY_FORMS = ("id", "displaced", "retry")
key_specs = st.tuples(st.sampled_from(KEY_FORMS), st.sampled_from(SUBJECTS), st.sampled_from(("x", "y")))
scheduled_specs = st.tuples(
    st.sampled_from(SUBJECTS),
    st.sampled_from(("x", "y")),
    st.sampled_from((NOW + 10 * SECOND, NOW + HOUR_MS + 5 * SECOND)),
    st.sampled_from((None, "k1", "k2")),
    st.sampled_from((0, 0, 1)),
)
changes = st.lists(
    st.one_of(
        st.tuples(st.just("schedule"), st.lists(scheduled_specs, min_size=1, max_size=3)),
        st.tuples(st.just("cancel"), st.lists(key_specs, min_size=1, max_size=2)),
        st.tuples(st.just("move"), st.lists(key_specs, min_size=1, max_size=2)),
    ),
    min_size=1,
    max_size=16,
)


def spec_key(form: str, subject: str, message_id: str) -> str:
    if form == "displaced":
        return displaced_key(message_id, subject)
    return index_key(message_id, subject, 1 if form == "retry" else 0)


def apply_change(master: Master, root: Path, change: str, specs: list[Any]) -> None:
    """Append what a master appends for the change (a CANCEL or MOVE only of what is
    scheduled), then file the whole log."""
    if change == "schedule":
        master.schedule([record(s, i, at, key, attempts) for s, i, at, key, attempts in specs])
    else:
        keys = list(dict.fromkeys(spec_key(*spec) for spec in specs))
        scheduled = [(k, v) for k, v in zip(keys, lookup(master.state, keys)) if v is not None and v.state == SCHEDULED]
        if scheduled and change == "cancel":
            master.log.append(cancel_record([k for k, _v in scheduled], taken_at=NOW))
        elif scheduled:
            found = filed_records(root / "schedule", [(v.hour, v.entry) for _k, v in scheduled])
            to = NOW + 2 * HOUR_MS + master.log.end_offset % 7 * SECOND  # varied, as the log grows
            master.log.append(move_record([redeliver_at(r, to) for r in found if r is not None]))
        master.log.flush()
    replay_until_caught_up(master.log, master.store)
    master.tail.filed(master.store.checkpoint)


def record_starts(data: bytes) -> list[int]:
    """Every record boundary of a message log's bytes, its end included."""
    starts = [0]
    while starts[-1] < len(data):
        starts.append(starts[-1] + HEADER_SIZE + int.from_bytes(data[starts[-1] : starts[-1] + 4], "big"))
    return starts


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(changes, st.integers(min_value=0, max_value=1_000))
def test_a_cut_back_leaves_the_index_that_filing_the_log_up_to_the_cut_gives(ops: list[Any], pick: int) -> None:
    """SCHEDULE, CANCEL and MOVE records of a few (subject, id) pairs, as a master appends
    them, filed; then cut back at any record: the index is the one filing only the log before
    the cut builds from scratch (what the new master holds)."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        master = Master(root / "master")
        reference = None
        try:
            for change, specs in ops:
                apply_change(master, root / "master", change, specs)
            data = master.log.read_raw(0, 1 << 30)[0]
            starts = record_starts(data)
            offset = starts[pick % len(starts)]
            reference = Folder(root / "reference")
            if offset:
                reference.log.append(data[:offset])
                reference.log.flush()
                replay_until_caught_up(reference.log, reference.store)
            cut_back(master, root / "master", offset)
            assert master.index() == reference.index()
        finally:
            master.close()
            if reference is not None:
                reference.close()
