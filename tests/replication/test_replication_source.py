"""Log shipping without sockets: EpochHistory's rules, ReplicationSource's answers, a
ReplicaFetcher against a source over a MemoryNetwork (docs/replication.md)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import trio

from delaymq.client.registration import Registration
from delaymq.clock import TrioClock
from delaymq.net.requests import Request
from delaymq.net.server import FrameServer
from delaymq.net.testing import MemoryNetwork
from delaymq.protocol.commands import Command
from delaymq.protocol.envelope import RecordKind, encode
from delaymq.protocol.errors import RemoteProtocolError
from delaymq.replication.epochs import EpochHistory
from delaymq.replication.fetcher import ReplicaFetcher
from delaymq.replication.source import DEFAULT_LAG_MS, ReplicationSource
from delaymq.replication.wire import OFFSET_DELETED, FetchAnswer, FetchRequest
from delaymq.storage.log import SegmentedLog
from delaymq.storage.state import StateStore
from delaymq.storage.threads import run_inline

MASTER, SLAVE = "master.test:1", "slave.test:1"


def test_epoch_history_finds_where_two_logs_part() -> None:
    master = EpochHistory([(1, 0), (3, 500), (7, 900)])
    assert master.latest == 7
    assert master.end_of(1, 1_000) == 500  # epoch 1's writes end where epoch 3 began
    assert master.end_of(2, 1_000) == 500  # an epoch this log never had: the one before it
    assert master.end_of(7, 1_000) == 1_000
    slave = EpochHistory()
    assert slave.adopt(master.entries, 600) and slave.entries == [(1, 0), (3, 500)]
    assert not slave.adopt(master.entries, 600)
    slave.cut(400)
    assert slave.entries == [(1, 0)]
    assert not master.begin(7, 950) and master.begin(8, 950)
    with pytest.raises(ValueError, match="epochs must rise"):
        EpochHistory([(2, 10), (1, 20)])


def test_epoch_history_is_kept_in_the_state_store(tmp_path: Path) -> None:
    with StateStore.open(tmp_path) as state:
        history = EpochHistory()
        history.begin(5, 0)
        history.begin(9, 1234)
        history.save(state)
    with StateStore.open(tmp_path) as state:
        assert EpochHistory.load(state).entries == [(5, 0), (9, 1234)]


def record(i: int) -> bytes:
    return encode(RecordKind.OPAQUE, f"record-{i}".encode())


class Master:
    """A log and a source serving FETCH on a MemoryNetwork."""

    def __init__(self, tmp: Path, clock: TrioClock, **options: Any) -> None:
        self.log = SegmentedLog.open(tmp / "master", segment_size=options.pop("segment_size", 1 << 20))
        self.history = EpochHistory([(1, 0)])
        self.snapshots = 0
        self.source = ReplicationSource(
            log=self.log, history=self.history, epoch=1, clock=clock, run_blocking=run_inline,
            tick=lambda: b"tick", snapshot=self.snapshot, **options,
        )  # fmt: skip
        self.frames = FrameServer({Command.FETCH: self.fetch})

    def snapshot(self) -> list[bytes]:
        self.snapshots += 1
        return [b"everything"]

    async def fetch(self, request: Request) -> tuple[dict[str, Any], bytes]:
        answer, body = await self.source.serve_fetch(FetchRequest.from_metadata(request.metadata))
        return answer.as_metadata(), body

    def write(self, *items: int) -> None:
        for i in items:
            self.log.append(record(i))
        self.log.flush()
        self.source.poke()


class Owner:
    def __init__(self) -> None:
        self.journal: list[tuple[list[bytes], bool]] = []
        self.ticks = 0
        self.agreed_at = 0
        self.cuts: list[int] = []
        self.log: SegmentedLog | None = None

    async def take_journal(self, entries: list[bytes], *, reset: bool) -> None:
        self.journal.append((entries, reset))

    def take_tick(self, tick: bytes, *, master_now_ms: int, master_durable_end: int) -> None:
        self.ticks += 1

    async def cut_back(self, offset: int) -> None:
        assert self.log is not None
        self.cuts.append(offset)
        self.log.truncate(offset)

    def agreed(self, offset: int) -> None:
        self.agreed_at = offset


async def test_a_fetcher_copies_the_log_byte_for_byte_and_acknowledges_what_it_holds(
    tmp_path: Path, autojump_clock: Any
) -> None:
    clock = TrioClock(1_700_000_000_000)
    master = Master(tmp_path, clock, min_insync=1)
    owner = Owner()
    with master.log, SegmentedLog.open(tmp_path / "slave") as slave_log, StateStore.open(tmp_path / "state") as state:
        async with trio.open_nursery() as nursery:
            net = MemoryNetwork(nursery)
            net.serve(MASTER, master.frames.serve_stream)
            owner.log = slave_log
            fetcher = ReplicaFetcher(
                group="g", address=SLAVE, master=MASTER, epoch=1, log=slave_log, history=EpochHistory(),
                state=state, owner=owner, peers=net, clock=clock, run_blocking=run_inline,
            )  # fmt: skip
            with pytest.raises(RemoteProtocolError, match="0 slave"):
                master.source.check_insync("SCHEDULE")  # nobody holds anything yet: refused, retryable
            master.write(*range(50))
            nursery.start_soon(fetcher.run)
            assert await master.source.wait_replicated(master.log.end_offset, timeout_ms=10_000)
            assert master.source.in_sync() == [SLAVE]
            master.source.check_insync("SCHEDULE")
            assert master.source.high_watermark() == master.log.end_offset
            assert slave_log.read_raw(0, 1 << 20)[0] == master.log.read_raw(0, 1 << 20)[0]
            master.source.journal_append(b"round-1")
            await trio.sleep(0.2)
            assert owner.journal[0] == ([b"everything"], True)  # first contact: a snapshot
            assert owner.journal[-1] == ([b"round-1"], False)
            ticks = owner.ticks
            await trio.sleep(1)
            assert owner.ticks >= ticks + 15  # a tick at least every 50 ms, even with nothing new
            assert master.source.holds_all(SLAVE)
            nursery.cancel_scope.cancel()


async def test_a_slave_that_stops_fetching_falls_out_of_sync(tmp_path: Path, autojump_clock: Any) -> None:
    clock = TrioClock(1_700_000_000_000)
    master = Master(tmp_path, clock, min_insync=1, lag_ms=10_000)
    with master.log:
        master.write(1, 2, 3)
        request = FetchRequest(group="g", address=SLAVE, epoch=1, offset=master.log.end_offset, last_epoch=1)
        await master.source.serve_fetch(request)
        assert master.source.in_sync() == [SLAVE]
        master.write(4)
        assert not await master.source.wait_replicated(master.log.end_offset, timeout_ms=11_000)
        assert master.source.in_sync() == []
        [progress] = master.source.statistics().replicas
        assert (progress.in_sync, progress.lag_bytes) == (False, len(record(4)))


async def test_a_write_is_answered_once_every_in_sync_slave_holds_it_not_just_min_insync(
    tmp_path: Path, autojump_clock: Any
) -> None:
    """The metaserver may promote any slave the master last reported in sync: with two in sync
    and ``min_insync`` 1, a write on only one of them was answered, and lost when the other was
    promoted (a fault test saw acked messages handed out again)."""
    clock = TrioClock(1_700_000_000_000)
    master = Master(tmp_path, clock, min_insync=1, lag_ms=10_000)
    other = "slave-2.test:1"
    with master.log:
        master.write(1, 2)
        for address in (SLAVE, other):
            await master.source.serve_fetch(
                FetchRequest(group="g", address=address, epoch=1, offset=master.log.end_offset, last_epoch=1)
            )
        assert master.source.in_sync() == sorted([SLAVE, other])
        master.write(3)
        end = master.log.end_offset
        answered: list[int] = []

        async def wait() -> None:
            if await master.source.wait_replicated(end, timeout_ms=60_000):
                answered.append(clock.monotonic_ms())

        async def keep_fetching() -> None:  # SLAVE holds the write now and goes on asking
            request = FetchRequest(group="g", address=SLAVE, epoch=1, offset=end, last_epoch=1)
            while True:  # a long poll: the tick answers it within 50 ms
                answer, _body = await master.source.serve_fetch(request)
                request = dataclasses.replace(request, session=answer.session, seq=answer.seq)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            await trio.sleep(0.5)
            nursery.start_soon(keep_fetching)
            await trio.sleep(0.5)
            assert answered == []  # one of two in-sync slaves holds it: not yet
            assert master.source.high_watermark() < end
            started = clock.monotonic_ms()
            await trio.sleep(11)  # the other stays silent: it leaves the in-sync set, and the wait ends
            assert master.source.in_sync() == [SLAVE]
            assert answered and answered[0] - started <= 10_000 + 500
            assert master.source.high_watermark() == end
            nursery.cancel_scope.cancel()


async def test_fetch_answers_a_cut_for_a_tail_the_master_never_had_and_refuses_a_deleted_start(
    tmp_path: Path, autojump_clock: Any
) -> None:
    clock = TrioClock(1_700_000_000_000)
    master = Master(tmp_path, clock, segment_size=len(record(0)) * 2)
    with master.log:
        master.write(*range(6))
        master.history.begin(2, master.log.end_offset)
        master.source.epoch = 2
        deposed_end = master.log.end_offset + 40  # a deposed master of epoch 1 holds 40 bytes more
        answer, body = await master.source.serve_fetch(
            FetchRequest(group="g", address=SLAVE, epoch=2, offset=deposed_end, last_epoch=1)
        )
        assert (answer.truncate_to, body) == (master.log.end_offset, b"")
        master.log.delete_before(4 * len(record(0)))
        with pytest.raises(RemoteProtocolError) as refused:
            await master.source.serve_fetch(FetchRequest(group="g", address=SLAVE, epoch=2, offset=0, last_epoch=0))
        assert refused.value.code == OFFSET_DELETED and refused.value.limit == master.log.start_offset
        assert "copy of the master's" in str(refused.value)
        newer = FetchRequest(group="g", address=SLAVE, epoch=3, offset=0, last_epoch=0)
        with pytest.raises(RemoteProtocolError, match="it was replaced"):
            await master.source.serve_fetch(newer)


def test_fetch_metadata_is_checked_field_by_field() -> None:
    good = FetchRequest(group="g", address=SLAVE, epoch=1, offset=0, last_epoch=0).as_metadata()
    assert FetchRequest.from_metadata(good).address == SLAVE
    for field, bad in (("offset", -1), ("epoch", "one"), ("group", ""), ("max_bytes", 0)):
        with pytest.raises(RemoteProtocolError) as refused:
            FetchRequest.from_metadata({**good, field: bad})
        assert refused.value.field == field
    with pytest.raises(RemoteProtocolError) as refused:
        FetchAnswer.from_metadata({"journal": "nope"})
    assert refused.value.field == "journal"


async def test_a_slave_the_journal_has_moved_past_gets_a_snapshot_the_others_only_what_they_lack(
    tmp_path: Path, autojump_clock: Any
) -> None:
    clock = TrioClock(1_700_000_000_000)
    master = Master(tmp_path, clock, journal_entries=4)
    with master.log:
        master.write(1)
        end = master.log.end_offset
        first, _body = await master.source.serve_fetch(
            FetchRequest(group="g", address=SLAVE, epoch=1, offset=end, last_epoch=1)
        )
        assert first.reset and first.journal == [b"everything"]
        for i in range(10):  # the journal keeps at least the newest 4 entries
            master.source.journal_append(f"round-{i}".encode())
        near = FetchRequest(group="g", address=SLAVE, epoch=1, offset=end, last_epoch=1, session=first.session, seq=7)
        answer, _body = await master.source.serve_fetch(near)
        assert (answer.reset, answer.journal, answer.seq) == (False, [b"round-7", b"round-8", b"round-9"], 10)
        far = FetchRequest(group="g", address=SLAVE, epoch=1, offset=end, last_epoch=1, session=first.session, seq=1)
        answer, _body = await master.source.serve_fetch(far)
        assert (answer.reset, answer.journal, answer.seq) == (True, [b"everything"], 10)
        assert master.snapshots == 2


async def test_a_fetcher_stuck_at_one_offset_stops_holding_back_deletion_after_the_window(
    tmp_path: Path, autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A slave (or anything posing as one) that keeps fetching from one offset while the
    log moves on holds back segment deletion only for ``retain_for_ms``; one that advances,
    however slowly, keeps holding it back."""
    clock = TrioClock(1_700_000_000_000)
    master = Master(tmp_path, clock, retain_for_ms=60_000, lag_ms=10_000)
    stuck, slow = "stuck.test:1", SLAVE
    with master.log:
        master.write(0)
        slow_at = 0
        ends = [master.log.end_offset]
        for i in range(1, 130):  # a fetch of each a second while the log grows: 129 s
            master.write(i)
            ends.append(master.log.end_offset)
            await master.source.serve_fetch(FetchRequest(group="g", address=stuck, epoch=1, offset=0, last_epoch=1))
            if i % 20 == 0:  # behind, but it moves on every 20 s
                slow_at = ends[-4]
                await master.source.serve_fetch(
                    FetchRequest(group="g", address=slow, epoch=1, offset=slow_at, last_epoch=1)
                )
            if i == 59:
                assert master.source.retain_from() == 0  # within the window: still kept for it
            await trio.sleep(1)
        assert master.source.in_sync() == []
        assert master.source.retain_from() == slow_at  # the stuck one no longer counts, the slow one does
        assert any(stuck in r.getMessage() and "no longer holds back" in r.getMessage() for r in caplog.records)
        await master.source.serve_fetch(FetchRequest(group="g", address=stuck, epoch=1, offset=ends[0], last_epoch=1))
        assert master.source.retain_from() == ends[0]  # it advanced: it counts again


async def test_a_silent_slave_holds_writes_until_the_metaserver_records_the_set_without_it(
    tmp_path: Path, autojump_clock: Any
) -> None:
    """A master cut off from the metaserver (and from its slave) can never answer a write alone:
    the slave leaves the set it waits for only once the metaserver recorded that."""
    clock = TrioClock(1_700_000_000_000)
    master = Master(tmp_path, clock)  # the defaults: sync, min_insync 0
    with master.log:
        master.write(1)
        await master.source.serve_fetch(
            FetchRequest(group="g", address=SLAVE, epoch=1, offset=master.log.end_offset, last_epoch=1)
        )
        master.source.record_in_sync([SLAVE])
        master.write(2)
        end = master.log.end_offset
        answered: list[bool] = []

        async def wait() -> None:
            answered.append(await master.source.wait_replicated(end, timeout_ms=60_000))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            await trio.sleep(DEFAULT_LAG_MS / 1000 + 1)
            assert master.source.in_sync() == []  # what it reports: the slave fell behind
            assert answered == [] and master.source.high_watermark() < end  # but it is still waited for
            await trio.sleep(30)
            assert answered == []
            master.source.record_in_sync([])  # the metaserver's answer: recorded without it
            await trio.testing.wait_all_tasks_blocked()
            assert answered == [True] and master.source.high_watermark() == end


async def test_a_master_alone_answers_at_once_and_a_recorded_slave_it_never_heard_is_waited_for(
    tmp_path: Path, autojump_clock: Any
) -> None:
    clock = TrioClock(1_700_000_000_000)
    master = Master(tmp_path, clock)
    with master.log:
        master.write(1)
        master.source.check_insync("SEND")  # min_insync 0: a group of one serves
        assert await master.source.wait_replicated(master.log.end_offset, timeout_ms=1)
        assert master.source.high_watermark() == master.log.end_offset
        # A restarted master's group still records SLAVE in sync: it waits for it to fetch.
        master.source.record_in_sync([SLAVE])
        master.write(2)
        end = master.log.end_offset
        assert master.source.in_sync() == [SLAVE]  # reported in sync for its grace
        assert not await master.source.wait_replicated(end, timeout_ms=500)
        await master.source.serve_fetch(FetchRequest(group="g", address=SLAVE, epoch=1, offset=end, last_epoch=1))
        assert await master.source.wait_replicated(end, timeout_ms=1)


async def test_a_slave_that_keeps_up_with_a_steady_stream_stays_in_sync(tmp_path: Path, autojump_clock: Any) -> None:
    """Each fetch holds what was durable at the one before, never the very end (the log moves on
    meanwhile): that is in sync, however long it lasts."""
    clock = TrioClock(1_700_000_000_000)
    master = Master(tmp_path, clock)
    with master.log:
        master.write(0)
        held = 0
        for i in range(1, 100):
            end = master.log.end_offset
            await master.source.serve_fetch(FetchRequest(group="g", address=SLAVE, epoch=1, offset=held, last_epoch=1))
            held = end
            master.write(i)  # arrives while the slave writes what it fetched
            await trio.sleep(0.1)
        assert master.log.end_offset > held
        assert master.source.in_sync() == [SLAVE]
        await trio.sleep(DEFAULT_LAG_MS / 1000 + 0.1)  # then it stops fetching
        assert master.source.in_sync() == []


async def test_a_master_that_hears_neither_the_metaserver_nor_its_slaves_refuses_at_once(
    tmp_path: Path, autojump_clock: Any
) -> None:
    """Cut off from the metaserver and its in-sync slaves (they follow a new master), a master's
    writes could never be confirmed: it says so at once, not after the replication timeout."""
    clock = TrioClock(1_700_000_000_000)
    master = Master(tmp_path, clock)
    info = {"group": "g", "kind": "scheduler", "role": "master", "address": MASTER, "version": "0"}
    registration = Registration(info, interval_ms=200)
    registration.answered_sent_ms = clock.monotonic_ms()
    master.source.report_to(registration)
    with master.log:
        master.write(1)
        end = master.log.end_offset
        fetch = FetchRequest(group="g", address=SLAVE, epoch=1, offset=end, last_epoch=1)
        await master.source.serve_fetch(fetch)
        master.source.record_in_sync([SLAVE])
        await trio.sleep(1)
        registration.answered_sent_ms = clock.monotonic_ms()
        assert master.source.stranded() is None  # the metaserver answers: it records the slave's leaving
        await master.source.serve_fetch(dataclasses.replace(fetch, session=master.source.session))
        await trio.sleep(1)  # neither the metaserver nor the slave since
        reason = master.source.stranded()
        assert reason is not None and SLAVE in reason and "may have been replaced" in reason
        master.write(2)
        began = clock.monotonic_ms()
        with pytest.raises(RemoteProtocolError, match="may have been replaced"):
            await master.source.confirm_replicated(master.log.end_offset, timeout_ms=5_000, what="SEND")
        assert clock.monotonic_ms() - began < 500
        # Cut off from the metaserver alone, it serves on: its slave fetches.
        async with trio.open_nursery() as nursery:

            async def keep_fetching() -> None:
                request = dataclasses.replace(fetch, offset=master.log.end_offset)
                while True:
                    answer, _body = await master.source.serve_fetch(request)
                    request = dataclasses.replace(request, session=answer.session, seq=answer.seq)

            nursery.start_soon(keep_fetching)
            await trio.sleep(1)
            assert master.source.stranded() is None
            await master.source.confirm_replicated(master.log.end_offset, timeout_ms=5_000, what="SEND")
            nursery.cancel_scope.cancel()
