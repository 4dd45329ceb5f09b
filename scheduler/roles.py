"""A scheduler member's two roles: master (schedules, files, dispatches, serves FETCH)
and slave (fetches the master's log, files it, keeps the master's dispatch records).

The metaserver says which role a member has (``Registration.view()``); the server's
role loop runs one session at a time and replaces it when the role, the epoch or the
master changes. Both sessions share the member's storage (``Member``).

- ``MasterSession.run``: on promotion it first files everything the member received,
  writes the dispatch records it holds, forgets the ones naming entries it never got,
  and records where its epoch begins (``EpochHistory``); then it builds its wheels
  from the schedule and dispatch logs exactly as a restart does, so everything due
  and not recorded as dispatched goes out at once, oldest first, and nothing before
  its ``deliver_at`` by this member's own clock. It files only what every
  slave of the in-sync set holds (the high watermark) under sync replication, so a deposed master never
  filed what the group does not have. A graceful handover (``handover_to``) stops
  SCHEDULE and firing, drains, waits until the target holds the log and every
  dispatch record, then reports ``handed_over``.
- ``SlaveSession.run``: a ``ReplicaFetcher`` and a replay loop that files what arrives
  and writes held dispatch records once their entries are filed.
- ``delaymq.replication.roles.Mastership``: a master frozen (SIGSTOP) or starved asks
  the metaserver again before it dispatches or accepts anything.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial

import trio

from delaymq.client.registration import Registration
from delaymq.clock import Alarm, Clock
from delaymq.net.peers import AsyncCaller
from delaymq.replication.epochs import EpochHistory
from delaymq.replication.fetcher import ReplicaFetcher
from delaymq.replication.roles import Handover, Mastership
from delaymq.replication.shell import finish_handover
from delaymq.replication.source import ReplicationSource
from delaymq.scheduler.cancels import Holds, Tail
from delaymq.scheduler.dispatcher import Deliver, Dispatcher
from delaymq.scheduler.replay import replay_step, replay_until_caught_up
from delaymq.scheduler.replica import DispatchRecords, MasterTick, dispatch_record, snapshot_records
from delaymq.scheduler.schedulelog import ScheduleStore
from delaymq.scheduler.staging import ReplayStep
from delaymq.scheduler.wheelset import WheelSet
from delaymq.storage.inflight import KeysInFlight
from delaymq.storage.log import SegmentedLog
from delaymq.storage.state import StateStore
from delaymq.storage.threads import RunBlocking
from delaymq.storage.writer import LogWriter
from delaymq.wheel import Tick

log = logging.getLogger(__name__)

#: How often replay looks again while the log holds appended, not yet durable records.
_UNFLUSHED_POLL_MS = 50


@dataclass(slots=True)
class Member:
    """What both roles of one scheduler member share: its storage and its settings."""

    group: str
    address: str
    clock: Clock
    log: SegmentedLog
    state: StateStore
    store: ScheduleStore
    history: EpochHistory
    records: DispatchRecords
    run_blocking: RunBlocking
    peers: AsyncCaller | None
    registration: Registration | None
    replay_bytes: int
    mode: str  # "sync" | "async"
    min_insync: int
    #: Held around each filing step and dispatch-record write of a slave, and around a
    #: cut-back (which closes and reopens the store).
    filing: trio.Lock = field(default_factory=trio.Lock)
    #: The master's SCHEDULE writer (set once it is open): a handover waits for it to be idle.
    writer: LogWriter | None = None


class MasterSession:
    """The member as its group's master for one epoch."""

    def __init__(
        self,
        member: Member,
        *,
        epoch: int,
        make_wheels: Callable[[list[int]], WheelSet],
        make_dispatcher: Callable[[WheelSet, Deliver, Callable[[dict[int, list[int]]], None]], Dispatcher],
        deliver: Callable[[int, Mastership], Deliver],
    ) -> None:
        self.member = member
        self.epoch = epoch
        self.accepting = False
        self.handover = Handover(
            what=f"scheduler {member.group}", epoch=epoch, hand_over=self._hand_over, resume=self._resume
        )
        self.mastership = Mastership(member.clock, member.registration, epoch)
        self.wheels = make_wheels([])
        self.source = ReplicationSource(
            log=member.log,
            history=member.history,
            epoch=epoch,
            clock=member.clock,
            run_blocking=member.run_blocking,
            tick=self._tick,
            snapshot=partial(snapshot_records, member.store),
            mode=member.mode,
            min_insync=member.min_insync,
        )
        self._make_wheels = make_wheels
        self._make_dispatcher = make_dispatcher
        self._deliver = deliver
        self.dispatcher: Dispatcher | None = None
        self.replay_alarm = Alarm(member.clock)
        self.source.on_acked = self.replay_alarm.poke
        if member.registration is not None:
            self.source.report_to(member.registration)
        self.pending = 0
        self.filed = 0
        self.cancelled = 0  # entries cancelled by filing CANCEL and MOVE records in this master term
        #: CANCEL / MOVE / QUERY / duplicates (``delaymq.scheduler.cancels``): the unfiled tail's
        #: word on ids, the ids being appended or cancelled now, the entries held back.
        self.tail = Tail()
        self.appending = KeysInFlight()
        self.cancelling = KeysInFlight()
        self.holds: Holds | None = None
        #: Set (and replaced) after each replay step: what waits for its records to be filed.
        self.step_filed = trio.Event()

    def _tick(self) -> bytes:
        return self.wheels.tick(self.member.clock.now_ms()).encode()

    def _journal(self, rounds: dict[int, list[int]]) -> None:
        for hour, entries in rounds.items():
            self.source.journal_append(dispatch_record(hour, entries))

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        member = self.member
        step, hours, pending, dropped = await member.run_blocking(partial(_take_over, member, self.epoch))
        if dropped:
            log.warning(
                "scheduler %s: %d dispatch record(s) name entries this member never received (the old master's "
                "unreplicated tail); dropped",
                member.group,
                dropped,
            )
        self.wheels = self._make_wheels(hours)
        self.dispatcher = self._make_dispatcher(self.wheels, self._deliver(self.epoch, self.mastership), self._journal)
        self.holds = Holds(self.wheels, self.dispatcher)
        self.dispatcher.skip = self.holds.skip
        self.pending = pending
        log.warning(
            "scheduler %s: master of epoch %d at %s (log end %d, %d record(s) filed now, %d message(s) to deliver "
            "in %d hour(s); replication %s, min_insync %d)",
            member.group, self.epoch, member.address or "-", member.log.end_offset, step.filed, pending, len(hours),
            member.mode, member.min_insync,
        )  # fmt: skip
        async with trio.open_nursery() as nursery:
            await nursery.start(self.dispatcher.run)
            nursery.start_soon(self._replay_loop)
            nursery.start_soon(self.mastership.watch)
            if member.registration is not None:
                nursery.start_soon(self.handover.run, member.registration)
                nursery.start_soon(self.source.follow_recorded_in_sync, member.registration)
            self.accepting = True
            task_status.started()

    async def _replay_loop(self) -> None:
        member, wheels = self.member, self.wheels
        assert self.dispatcher is not None
        dispatcher = self.dispatcher
        sync = member.mode == "sync"
        while True:
            while True:
                until = self.source.high_watermark() if sync else None
                step = await member.run_blocking(
                    partial(replay_step, member.log, member.store, max_bytes=member.replay_bytes, until=until)
                )
                if step.idle:
                    break
                self.filed += step.filed
                self.cancelled += sum(map(len, step.cancelled.values()))
                for hour, arrivals in step.arrivals.items():
                    wheels.arrive(hour, arrivals.first_entry, arrivals.ms_in_hour)
                self.tail.filed(step.checkpoint)
                if self.holds is not None:
                    self.holds.prune(step.checkpoint, member.clock.now_ms())
                filed, self.step_filed = self.step_filed, trio.Event()
                filed.set()
                dispatcher.poke()
            if member.log.flushed_offset < member.log.end_offset or member.store.checkpoint < member.log.flushed_offset:
                await self.replay_alarm.wait_ms(_UNFLUSHED_POLL_MS)
            else:
                await self.replay_alarm.wait(None)

    async def _hand_over(self, target: str) -> None:
        """Stop taking SCHEDULEs and firing, record what realtime accepted, wait until
        ``target`` holds the whole log (SCHEDULEs accepted before the stop included)."""
        self.accepting = False
        assert self.dispatcher is not None and self.member.writer is not None
        await self.dispatcher.drain()
        await finish_handover(self.member.writer, self.source, target)

    def _resume(self) -> None:
        assert self.dispatcher is not None
        self.dispatcher.resume()
        self.accepting = True


def _take_over(member: Member, epoch: int) -> tuple[ReplayStep, list[int], int, int]:
    """File all that was received, settle held dispatch records, begin the epoch (blocking)."""
    step = replay_until_caught_up(member.log, member.store, max_bytes=member.replay_bytes)
    member.records.settle()
    dropped = member.records.drop()
    if member.history.begin(epoch, member.log.end_offset):
        member.history.save(member.state)
    hours = member.store.undispatched_hours()
    return step, hours, sum(member.store.pending(hour) for hour in hours), dropped


class SlaveSession:
    """The member as a slave of ``master`` in ``epoch``. Also the fetcher's owner."""

    def __init__(self, member: Member, *, master: str, epoch: int, on_cut: Callable[[int], Awaitable[None]]) -> None:
        assert member.peers is not None
        self.member = member
        self.master_address = master
        self.epoch = epoch
        self.master_tick: MasterTick | None = None
        self.filed = 0
        #: Filing stops here until the master has answered: a deposed master's own tail
        #: past it may be one the new master never had (and is cut, unfiled).
        self.agreed_offset = member.store.checkpoint
        self._on_cut = on_cut
        self.replay_alarm = Alarm(member.clock)
        self.fetcher = ReplicaFetcher(
            group=member.group,
            address=member.address,
            master=master,
            epoch=epoch,
            log=member.log,
            history=member.history,
            state=member.state,
            owner=self,
            peers=member.peers,
            clock=member.clock,
            run_blocking=member.run_blocking,
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        log.info(
            "scheduler %s: slave of %s (epoch %d) at %s",
            self.member.group,
            self.master_address,
            self.epoch,
            self.member.address,
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(self.fetcher.run)
            nursery.start_soon(self._replay_loop)
            task_status.started()

    async def _replay_loop(self) -> None:
        member = self.member
        while True:
            async with member.filing:
                step = await member.run_blocking(partial(_file_as_slave, member, self.agreed_offset))
            if step.idle:
                await self.replay_alarm.wait(None)
            else:
                self.filed += step.filed

    # -- ReplicaOwner ---------------------------------------------------------------

    async def take_journal(self, entries: list[bytes], *, reset: bool) -> None:
        async with self.member.filing:
            await self.member.run_blocking(partial(self.member.records.take, entries))

    def take_tick(self, tick: bytes, *, master_now_ms: int, master_durable_end: int) -> None:
        if tick:
            self.master_tick = MasterTick(
                Tick.decode(tick), master_now_ms, self.member.clock.monotonic_ms(), master_durable_end
            )

    async def cut_back(self, offset: int) -> None:
        await self._on_cut(offset)
        self.agreed_offset = min(self.agreed_offset, offset)

    def agreed(self, offset: int) -> None:
        self.agreed_offset = max(self.agreed_offset, offset)
        if self.member.store.checkpoint < self.agreed_offset:
            self.replay_alarm.poke()


def _file_as_slave(member: Member, until: int) -> ReplayStep:
    step = replay_step(member.log, member.store, max_bytes=member.replay_bytes, until=until)
    if not step.idle:
        member.records.settle(step.arrivals)
    return step


__all__ = ["MasterSession", "Member", "SlaveSession"]
