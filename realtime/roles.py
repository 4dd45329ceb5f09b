"""A realtime member's two roles: master (serves producers and consumers, serves FETCH)
and slave (fetches the master's message log, indexes it, applies its consumer progress).

The metaserver names the role (the shell, ``delaymq.replication.shell.ReplicatedServer``,
runs one session at a time); both sessions share the member's data folder (``Member``).

- ``MasterSession.run``: a managed member first applies everything it received as a
  slave (``replica.ReplicaState.catch_up``) and records where its epoch begins, then
  opens its data folder as a restart does (``master.open_master``), ships its whole
  consumer state as the first progress record of its epoch, and serves. When the
  session ends it commits a last checkpoint (not after a crash) and closes.
- ``SlaveSession.run``: a ``ReplicaFetcher`` and an apply loop (``ReplicaState.step``)
  that indexes and applies only what the master has confirmed (``agreed``): a deposed
  master's own tail past it may be one the new master never had, and is cut
  (``cut_back``: counted, logged; the ids of its messages leave the dedup window so a
  producer's retry is stored again).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial

import trio

from delaymq.client.registration import Registration
from delaymq.client.routes import RouteClient
from delaymq.clock import Alarm, Clock
from delaymq.net.limits import Limits
from delaymq.net.peers import AsyncCaller
from delaymq.protocol.backoff import Backoff, BackoffRun
from delaymq.protocol.errors import RemoteProtocolError
from delaymq.protocol.records import scan_batch
from delaymq.realtime.checkpoint import CONSUMERS_DB, load_index_offset
from delaymq.realtime.dedup import IDS_DB, dedup_keys
from delaymq.realtime.index import REPLAY_LIMITS
from delaymq.realtime.master import MasterSettings, RealtimeMaster, open_master
from delaymq.realtime.progress import MESSAGE_KIND, kind_runs
from delaymq.realtime.recovery import Storage
from delaymq.realtime.replica import ReplicaState
from delaymq.replication.epochs import EpochHistory
from delaymq.replication.fetcher import ReplicaFetcher
from delaymq.replication.roles import Handover, Mastership, NotMaster
from delaymq.replication.shell import InFlight, finish_handover
from delaymq.replication.source import ReplicationSource
from delaymq.replication.statistics import CutCounts
from delaymq.storage.errors import StorageError, describe
from delaymq.storage.threads import RunBlocking
from delaymq.storage.writer import LogWriter

log = logging.getLogger(__name__)

#: Retries of a failed apply step (a full disk): soon at first, at most a second apart.
_RETRY = Backoff(initial_ms=10, maximum_ms=1000, jitter="equal")


@dataclass(slots=True)
class Member:
    """What both roles of one realtime member share: its data folder and its settings."""

    group: str
    address: str
    clock: Clock
    limits: Limits
    storage: Storage
    history: EpochHistory
    settings: MasterSettings
    run_blocking: RunBlocking
    peers: AsyncCaller | None
    registration: Registration | None
    mode: str  # "sync" | "async"
    min_insync: int
    writer: LogWriter | None = None
    scheduler_routes: RouteClient | None = None
    #: Set by the crash hook: nothing more is committed on the way out.
    crashed: bool = False


class MasterSession:
    """The member as its group's master for one epoch (``managed``: it has a group to replicate to)."""

    def __init__(self, member: Member, *, epoch: int, managed: bool) -> None:
        self.member = member
        self.epoch = epoch
        self.accepting = False
        self.mastership = Mastership(member.clock, member.registration, epoch)
        self.source: ReplicationSource | None = None
        if managed:
            self.source = ReplicationSource(
                log=member.storage.message_log,
                history=member.history,
                epoch=epoch,
                clock=member.clock,
                run_blocking=member.run_blocking,
                tick=lambda: b"",
                snapshot=list,
                mode=member.mode,
                min_insync=member.min_insync,
            )
            if member.registration is not None:
                self.source.report_to(member.registration)
        self.master: RealtimeMaster | None = None
        self.requests = InFlight()  # what a handover lets end first
        self.handover = Handover(
            what=f"realtime {member.group}", epoch=epoch, hand_over=self._hand_over, resume=self._resume
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        member = self.member
        started = member.clock.monotonic_ms()
        master, applied, stored = await member.run_blocking(partial(_take_over, member, self.epoch, self.source))
        self.master = master
        master.writer = member.writer
        replicated = master.pull_handler.handed_out

        async def handed_out() -> None:
            await self.mastership.confirm()  # woken from a freeze: nothing goes out unless still master
            if replicated is not None:
                await replicated()

        master.pull_handler.handed_out = handed_out
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(master.committer.run)
                await nursery.start(master.sweeper.run)
                await nursery.start(partial(master.indexer_run, clock=member.clock))
                nursery.start_soon(self.mastership.watch)
                if self.source is not None and member.registration is not None:
                    nursery.start_soon(self.handover.run, member.registration)
                    nursery.start_soon(self.source.follow_recorded_in_sync, member.registration)
                if self.source is not None:
                    await self._ship_whole_state(master, stored)
                self.accepting = True
                log.log(
                    logging.WARNING if self.source is not None else logging.INFO,  # a promotion is news
                    "realtime %s: master of epoch %d at %s after %d ms (log end %d, %d progress record(s) applied "
                    "now; replication %s, min_insync %d)",
                    member.group, self.epoch, member.address or "-", member.clock.monotonic_ms() - started,
                    member.storage.message_log.end_offset, applied, member.mode, member.min_insync,
                )  # fmt: skip
                task_status.started()
        finally:
            self.accepting = False
            master.pull_handler.close(
                f"realtime server {member.address or '-'} is no longer master of epoch {self.epoch}"
            )
            if not member.crashed:
                with trio.CancelScope(shield=True):
                    master.committer.ship = None  # the slaves follow the next master now
                    await master.committer.commit_now()
            ended = NotMaster(f"realtime server {member.address or '-'} is no longer master of epoch {self.epoch}")
            master.committer.close(ended)  # requests still waiting for a checkpoint are refused, not stuck
            master.close()

    async def _ship_whole_state(self, master: RealtimeMaster, stored: list[tuple[bytes, bytes]]) -> None:
        """The epoch's first progress record: the whole state, so a slave that was behind (or a
        deposed master) starts from it. Retried until written (a full disk); nothing is served before."""
        backoff = BackoffRun(_RETRY)
        while True:
            try:
                await master.ship(master.full_progress(stored), wait=False)
                return
            except RemoteProtocolError as error:
                if not backoff.failures:
                    log.warning("realtime %s: the new master's state could not be written: %s; retrying",
                                self.member.group, error)  # fmt: skip
                await self.member.clock.sleep_ms(backoff.next_delay_ms())

    async def _hand_over(self, target: str) -> None:
        """Stop taking requests, ship the last progress, wait until ``target`` holds the whole log."""
        member, master, source = self.member, self.master, self.source
        assert master is not None and source is not None
        self.accepting = False
        master.pull_handler.closed = f"realtime server {member.address or '-'} is handing over to {target}"
        master.parked.wake_all()
        await self.requests.wait_idle()  # requests let in before the stop end first (a NACK's retry, an ACK's commit)
        await master.committer.commit_now()  # what consumers did so far goes out as a progress record
        assert member.writer is not None
        await finish_handover(member.writer, source, target)

    def _resume(self) -> None:
        assert self.master is not None
        self.master.pull_handler.closed = None
        self.accepting = True


def _take_over(
    member: Member, epoch: int, source: ReplicationSource | None
) -> tuple[RealtimeMaster, int, list[tuple[bytes, bytes]]]:
    """Apply what was received, begin the epoch, open the folder as a master (blocking).

    Returns the master, the progress records applied, and the committed consumer records
    (for the epoch's first progress record)."""
    storage = member.storage
    applied = 0
    stored: list[tuple[bytes, bytes]] = []
    if source is not None:
        state = _open_replica(member, slave=False)
        try:
            applied = state.catch_up(until=storage.message_log.end_offset, now=member.clock.now_ms())
        finally:
            state.close()
        if member.history.begin(epoch, storage.message_log.end_offset):
            member.history.save(storage.store)
    master = open_master(
        storage,
        group=member.group,
        clock=member.clock,
        limits=member.limits,
        settings=member.settings,
        run_blocking=member.run_blocking,
        source=source,
        scheduler_routes=member.scheduler_routes,
    )
    if source is not None:
        stored = storage.store.items(CONSUMERS_DB)
    return master, applied, stored


def _open_replica(member: Member, *, slave: bool = True) -> ReplicaState:
    settings = member.settings
    return ReplicaState.open(
        member.storage,
        now=member.clock.now_ms(),
        dedup_window_ms=settings.dedup_window_ms,
        dedup_memory_ids=settings.dedup_memory_ids,
        slave=slave,
    )


class SlaveSession:
    """The member as a slave of ``master`` in ``epoch``. Also the fetcher's owner."""

    def __init__(self, member: Member, *, master: str, epoch: int) -> None:
        assert member.peers is not None
        self.member = member
        self.master_address = master
        self.epoch = epoch
        self.state: ReplicaState | None = None
        #: Applying stops here until the master has answered (see the module docstring).
        self.agreed_offset = 0
        #: What this slave term cut back (``cut_back``).
        self.cut = CutCounts(messages=0)
        self._alarm = Alarm(member.clock)
        self._lock = trio.Lock()  # one apply step or cut at a time
        self.fetcher = ReplicaFetcher(
            group=member.group,
            address=member.address,
            master=master,
            epoch=epoch,
            log=member.storage.message_log,
            history=member.history,
            state=member.storage.store,
            owner=self,
            peers=member.peers,
            clock=member.clock,
            run_blocking=member.run_blocking,
        )

    @property
    def applied_offset(self) -> int:
        return self.state.applied_offset if self.state is not None else 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        member = self.member
        log.info(
            "realtime %s: slave of %s (epoch %d) at %s", member.group, self.master_address, self.epoch, member.address
        )
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.fetcher.run)
                nursery.start_soon(self._apply_loop)
                task_status.started()
        finally:
            if self.state is not None:
                self.state.close()

    async def _apply_loop(self) -> None:
        """Apply what the master confirmed, step by step; a failed step (a full disk) is
        retried with backoff from the folder's committed state, for as long as it takes."""
        member = self.member
        backoff = BackoffRun(_RETRY)
        while True:
            async with self._lock:
                try:
                    if self.state is None:
                        self.state = await member.run_blocking(partial(_open_replica, member))
                        self.agreed_offset = max(self.agreed_offset, self.state.applied_offset)
                    state = self.state
                    step = await member.run_blocking(
                        partial(state.step, until=self.agreed_offset, now=member.clock.now_ms())
                    )
                except (OSError, StorageError) as error:
                    if not backoff.failures:
                        log.warning(
                            "realtime %s: slave could not apply the log at offset %d: %s; retrying",
                            member.group, self.applied_offset, describe(error),
                        )  # fmt: skip
                    if self.state is not None:  # what the step did in memory is not committed: read again
                        self.state.close()
                        self.state = None
                    step = None
            if step is None:
                await member.clock.sleep_ms(backoff.next_delay_ms())
                continue
            if backoff.failures:
                log.info("realtime %s: slave applies the log again (offset %d)", member.group, self.applied_offset)
            backoff.reset()
            if step.idle:
                await self._alarm.wait(None)

    # -- ReplicaOwner ---------------------------------------------------------------

    async def take_journal(self, entries: list[bytes], *, reset: bool) -> None:
        """Realtime masters keep no side journal: their progress is in the log."""

    def take_tick(self, tick: bytes, *, master_now_ms: int, master_durable_end: int) -> None:
        """Realtime masters have no tick."""

    def agreed(self, offset: int) -> None:
        if offset > self.agreed_offset:
            self.agreed_offset = offset
            self._alarm.poke()

    async def cut_back(self, offset: int) -> None:
        """The log holds a tail the master never had: cut it and what was derived from it."""
        member = self.member
        async with self._lock:
            if self.state is not None:
                self.state.close()
                self.state = None
            applied = await member.run_blocking(partial(_cut, member.storage, offset))
            self._alarm.poke()  # the apply loop opens the state again
        records, messages, size, indexed = applied
        self.cut += CutCounts(records=records, bytes=size, messages=messages)
        self.agreed_offset = min(self.agreed_offset, offset)
        log.warning(
            "realtime %s: cut %d record(s) (%d message(s), %d bytes) from offset %d that the master never had%s",
            member.group, records, messages, size, offset,
            f"; {indexed} of those messages were already indexed here (async replication: they are lost)"
            if indexed else " (never acknowledged as replicated)",
        )  # fmt: skip


def _cut(storage: Storage, offset: int) -> tuple[int, int, int, int]:
    """Truncate the log at ``offset``; forget the ids of its messages (blocking).

    Returns (records, messages, bytes, messages already indexed). The consume logs and
    the checkpoint past the cut are repaired when the state is opened again
    (``recovery.recover`` cuts them back to the log's end)."""
    message_log = storage.message_log
    checkpoint = load_index_offset(storage.store)
    messages = indexed = 0
    ids: list[str] = []
    position = offset
    while True:
        data, next_offset = message_log.read_raw(position, 4 << 20)
        if not data:
            break
        for kind, start, end in kind_runs(data):
            if kind == MESSAGE_KIND:
                batch = scan_batch(data[start:end], REPLAY_LIMITS)
                ids += dedup_keys(batch)
                messages += len(batch)
                indexed += sum(1 for first in batch.starts if position + start + first < checkpoint)
        position = next_offset
    records = sum(1 for _ in message_log.iter_from(offset))
    if ids:  # first: a crash before the cut must not leave ids of messages this member no longer has
        with storage.store.write() as batch_:
            for message_id in ids:
                batch_.delete(IDS_DB, message_id.encode())
    size = message_log.truncate(offset)
    return records, messages, size, indexed


__all__ = ["MasterSession", "Member", "SlaveSession"]
