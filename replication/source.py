"""ReplicationSource: the master's side of log shipping.

It answers FETCH (``delaymq.replication.wire``): each request acknowledges the slave's
durable end and asks for what follows; the answer waits (long poll) until the master's
durable log grows, a side-journal entry is added, or ``tick_interval_ms`` (50 ms)
passes, so a slave hears the master's tick at least that often. It keeps each slave's
progress, says which slaves are **in sync** (fetched and caught up within
``lag_ms``), how far replication has reached (``high_watermark``), and lets a write
wait until its bytes are there (``wait_replicated``).

Under sync replication a write is answered once **every** slave of the in-sync set
holds it (Kafka's acks=all), and ``min_insync`` is only the floor below which writes
are refused. The set a write waits for is the one the metaserver has *recorded* at
this master's epoch (``record_in_sync``: the metaserver may promote any slave of it)
together with the slaves in sync here now. A slave joins at once (it holds everything
durable when it catches up); it leaves only once the metaserver has recorded a set
without it, so a master cut off from the metaserver can never drop its slaves and
acknowledge alone while a slave is promoted.

The side journal carries the owner's small records (the scheduler's dispatch-log
records) in order, numbered within this master's *session*; a slave that asks from a
position the journal no longer covers (a new master, or one it fell behind) gets a
snapshot from the owner instead (``reset``).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import trio

from delaymq.client.registration import Registration
from delaymq.clock import Clock
from delaymq.protocol.errors import RemoteProtocolError
from delaymq.replication.epochs import EpochHistory
from delaymq.replication.statistics import ReplicaProgress, SourceStatistics
from delaymq.replication.wire import OFFSET_DELETED, STALE_EPOCH, FetchAnswer, FetchRequest
from delaymq.storage.log import SegmentedLog
from delaymq.storage.threads import RunBlocking

log = logging.getLogger(__name__)

DEFAULT_TICK_INTERVAL_MS = 50
#: A slave that has not fetched, or not caught up, for this long leaves the in-sync set
#: (once the metaserver records it): writes stop waiting for a dead slave that soon.
DEFAULT_LAG_MS = 1_500
DEFAULT_JOURNAL_ENTRIES = 65_536
#: How often a replication wait looks again whether a silent slave left the in-sync set.
_RECHECK_S = 0.25
#: A master is *stranded* while the metaserver has not answered it for this many heartbeat
#: intervals and a slave of the recorded in-sync set has not fetched for ``STRANDED_SLAVE_MS``:
#: it has most likely been replaced (its slaves follow another master) and cannot learn it.
STRANDED_INTERVALS = 2
STRANDED_SLAVE_MS = 500
#: A slave silent this long, or out of sync and stuck at one offset this long, no longer
#: holds back the deletion of message-log segments.
DEFAULT_RETAIN_FOR_MS = 600_000


@dataclass(slots=True)
class _Replica:
    acked: int
    fetched_ms: int  # monotonic
    caught_up_ms: int | None  # monotonic: the last fetch that held everything durable
    session: str | None = None
    seq: int = 0  # journal entries of ``session`` it holds
    advanced_ms: int = 0  # monotonic: when ``acked`` last grew (or it was first heard from)
    stalled: bool = False  # logged as no longer holding back deletion, until it advances
    # The master's durable end when the previous fetch was answered, and that fetch's time: a fetch
    # from at least there means the slave was caught up then (Kafka's rule, so a slave that keeps up
    # with a steady stream counts as in sync though the log always moves on meanwhile).
    answered_durable: int = 0
    answered_ms: int = 0
    heard: bool = True  # False: recorded in sync by the metaserver, not heard from by this master yet


class ReplicationSource:
    """Serves FETCH for one master session. ``epoch`` and ``history`` are the session's."""

    def __init__(
        self,
        *,
        log: SegmentedLog,
        history: EpochHistory,
        epoch: int,
        clock: Clock,
        run_blocking: RunBlocking,
        tick: Callable[[], bytes],
        snapshot: Callable[[], list[bytes]],
        mode: str = "sync",
        min_insync: int = 0,
        lag_ms: int = DEFAULT_LAG_MS,
        tick_interval_ms: int = DEFAULT_TICK_INTERVAL_MS,
        journal_entries: int = DEFAULT_JOURNAL_ENTRIES,
        retain_for_ms: int = DEFAULT_RETAIN_FOR_MS,
    ) -> None:
        if mode not in ("sync", "async"):
            raise ValueError(f"replication mode must be 'sync' or 'async', got {mode!r}")
        if min_insync < 0:
            raise ValueError(f"min_insync must be >= 0, got {min_insync}")
        self.epoch = epoch
        self.mode = mode
        self.min_insync = min_insync
        self.session = secrets.token_hex(8)
        self._log = log
        self._history = history
        self._clock = clock
        self._run_blocking = run_blocking
        self._tick = tick
        self._snapshot = snapshot
        self._lag_ms = lag_ms
        self._tick_interval_ms = tick_interval_ms
        # The journal's entries numbered ``_journal_first + 1 ..``; cut back to the newest
        # ``journal_entries`` once it holds twice that, so an append and an answer's slice stay cheap.
        self._journal: list[bytes] = []
        self._journal_first = 0
        self._journal_entries = journal_entries
        self._seq = 0  # entries ever added since this master's term began
        self._retain_for_ms = retain_for_ms
        self._replicas: dict[str, _Replica] = {}
        self._recorded: frozenset[str] = frozenset()  # the metaserver's in-sync set at this epoch
        self._news = trio.Event()  # set when the log or the journal grew: wakes waiting fetches
        self._acks = trio.Event()  # set when a slave acknowledged more: wakes wait_replicated
        self._watermark = 0
        self._fetches = 0
        self._bytes_sent = 0
        self._resets = 0
        #: Told when a FETCH carries a newer epoch than this master's (it was replaced).
        self.on_stale_epoch: Callable[[int], None] = lambda epoch: None
        #: Told when a slave acknowledged more (the owner's filing may go further).
        self.on_acked: Callable[[], None] = lambda: None
        #: Told when a slave joins the in-sync set (the owner reports it to the metaserver now).
        self.on_joined_in_sync: Callable[[str], None] = lambda address: None
        #: How long the metaserver has not answered, and the longest it may stay so (None: never asked).
        self._metaserver_silence: Callable[[], tuple[int, int] | None] = lambda: None

    # -- the owner's side -------------------------------------------------------------

    def report_to(self, registration: Registration) -> None:
        """Heartbeat at once when a slave joins the in-sync set or a FETCH shows a newer epoch."""
        self.on_joined_in_sync = lambda address: registration.heartbeat_now()
        self.on_stale_epoch = lambda epoch: registration.heartbeat_now()

        def silence() -> tuple[int, int] | None:
            silent = registration.silent_ms(self._clock.monotonic_ms())
            return None if silent is None else (silent, STRANDED_INTERVALS * registration.heartbeat_interval_ms)

        self._metaserver_silence = silence

    def stranded(self) -> str | None:
        """Why this master must not take requests (None: it may): the metaserver has not answered
        it for ``STRANDED_INTERVALS`` heartbeats and a slave of the recorded in-sync set stopped
        fetching. Such a master has most likely been replaced; its writes could never be confirmed,
        so it refuses at once and its clients ask the metaserver instead of waiting on it. A master
        cut off from the metaserver alone keeps serving: its slaves still fetch."""
        silence = self._metaserver_silence()
        if silence is None or silence[0] <= silence[1]:
            return None
        now = self._clock.monotonic_ms()
        gone = sorted(a for a in self._recorded if now - self._replicas[a].fetched_ms > STRANDED_SLAVE_MS)
        if not gone:
            return None
        return (
            f"the metaserver has not answered it for {silence[0]} ms and in-sync slave(s) {', '.join(gone)} "
            "stopped fetching: it may have been replaced"
        )

    async def follow_recorded_in_sync(self, registration: Registration) -> None:
        """Until cancelled: take in each in-sync set the metaserver records at this epoch."""
        seen: tuple[int, tuple[str, ...] | None] = (0, None)
        while True:
            seen = await registration.wait_in_sync_change(seen)
            epoch, members = seen
            if epoch == self.epoch:
                self.record_in_sync(members)

    def poke(self) -> None:
        """The durable log grew (or something changed the tick): wake waiting fetches."""
        self._news.set()
        self._news = trio.Event()

    def journal_append(self, payload: bytes) -> None:
        """Add a side record (written durably by the owner first); slaves get it in order."""
        self._journal.append(payload)
        self._seq += 1
        if len(self._journal) >= 2 * self._journal_entries:
            drop = len(self._journal) - self._journal_entries
            del self._journal[:drop]
            self._journal_first += drop
        self.poke()

    def in_sync(self) -> list[str]:
        """Slaves that fetched, and were caught up, within ``lag_ms``: what this master reports."""
        now = self._clock.monotonic_ms()
        return sorted(address for address, replica in self._replicas.items() if self._is_in_sync(replica, now))

    def record_in_sync(self, members: tuple[str, ...] | list[str]) -> None:
        """The metaserver recorded ``members`` as this epoch's in-sync set (its heartbeat answer).

        A recorded slave this master has not heard from yet (after a handover, or a restart
        of the master) is counted in sync from now: writes wait for it until it fetches, or
        until ``lag_ms`` has passed and the metaserver records the set without it."""
        recorded = frozenset(members)
        if recorded == self._recorded:
            return
        now = self._clock.monotonic_ms()
        for address in recorded - self._replicas.keys():
            self._replicas[address] = _Replica(0, now, now, advanced_ms=now, heard=False)
        if self._recorded - recorded:
            log.info("in-sync set recorded at epoch %d: %s (without %s)", self.epoch,
                     ", ".join(sorted(recorded)) or "none", ", ".join(sorted(self._recorded - recorded)))  # fmt: skip
        self._recorded = recorded
        self._wake_waiters()

    def high_watermark(self) -> int:
        """What every slave a write waits for holds durably (the master's durable end when it
        waits for none, or under async replication); held while fewer than ``min_insync`` are
        in sync. Never moves back: the owner files records up to it."""
        durable = self._log.flushed_offset
        if self.mode != "sync":
            mark = durable
        else:
            held = self._waited()
            if len(held) < self.min_insync:
                mark = self._watermark
            else:
                mark = min([durable, *held])
        self._watermark = max(self._watermark, mark)
        return self._watermark

    def waits_for_slaves(self) -> bool:
        """Whether a write waits for any slave now (sync replication, a non-empty in-sync set)."""
        return self.mode == "sync" and bool(self._waited())

    def _waited(self) -> list[int]:
        """What each slave a write waits for holds: the recorded in-sync set and those in sync now."""
        now = self._clock.monotonic_ms()
        return [
            r.acked for address, r in self._replicas.items() if address in self._recorded or self._is_in_sync(r, now)
        ]

    def check_insync(self, what: str) -> None:
        """Refuse (retryably) when fewer than ``min_insync`` slaves are in sync: nothing is stored."""
        if self.mode != "sync" or not self.min_insync:
            return
        waited = self._waited()
        if len(waited) < self.min_insync:
            known = ", ".join(sorted(a for a, r in self._replicas.items() if r.heard)) or "none"
            raise RemoteProtocolError(
                f"{what}: replication is sync with min_insync {self.min_insync}, but {len(waited)} slave(s) are in "
                f"sync now (slaves known: {known}); nothing was stored, retry once a slave has caught up",
                code="unavailable",
                field="min_insync",
                limit=self.min_insync,
            )

    async def wait_replicated(self, offset: int, *, timeout_ms: int) -> bool:
        """Wait until every slave of the in-sync set (at least ``min_insync`` of them) holds
        everything below ``offset``; false on timeout. At once under async replication.

        Every one, not just ``min_insync``: the metaserver may promote any slave of the set it
        recorded, so an answered write must be on each of them. A slave that stops fetching
        leaves the set after ``lag_ms`` and the metaserver's record (and the wait with it).
        """
        if self.mode != "sync":
            return True
        with trio.move_on_after(timeout_ms / 1000):
            while True:
                acks = self._acks
                held = self._waited()
                if len(held) >= self.min_insync and all(acked >= offset for acked in held):
                    return True
                if self.stranded() is not None:
                    return False
                with trio.move_on_after(_RECHECK_S):  # a slave may leave the in-sync set by time alone
                    await acks.wait()
        return False

    async def confirm_replicated(self, offset: int, *, timeout_ms: int, what: str) -> None:
        """``wait_replicated``, refusing retryably (``unavailable``) on timeout."""
        if not await self.wait_replicated(offset, timeout_ms=timeout_ms):
            waited = ", ".join(sorted(self._recorded | set(self.in_sync()))) or "none"
            stranded = self.stranded()
            why = f"not confirmed within {timeout_ms} ms" if stranded is None else f"not confirmed ({stranded})"
            raise RemoteProtocolError(
                f"{what}: stored on the master but {why} by the in-sync slaves "
                f"({waited}; min_insync {self.min_insync}); retry with the same ids",
                code="unavailable",
                field="min_insync",
                limit=self.min_insync,
            )

    def holds_all(self, address: str) -> bool:
        """``address`` holds the whole durable log and every journal entry (a handover may end)."""
        replica = self._replicas.get(address)
        return (
            replica is not None
            and replica.acked >= self._log.flushed_offset
            and replica.session == self.session
            and replica.seq >= self._seq
        )

    async def wait_holds_all(self, address: str) -> None:
        """Return once ``address`` holds everything (``holds_all``); it tells so in its next FETCH."""
        while not self.holds_all(address):
            await self._acks.wait()

    def retain_from(self) -> int | None:
        """The lowest offset a slave still needs (None: no such slave): one heard from within
        ``retain_for_ms`` that is in sync or has advanced within ``retain_for_ms``. A slave
        that keeps fetching from one offset while the log moves on (a broken one, or a
        client posing as one) would otherwise keep every segment after it for good."""
        now = self._clock.monotonic_ms()
        window = self._retain_for_ms
        needed = []
        for address, r in self._replicas.items():
            if not r.heard or now - r.fetched_ms >= window:
                continue
            if now - r.advanced_ms < window or self._is_in_sync(r, now):
                needed.append(r.acked)
            elif not r.stalled:
                r.stalled = True
                log.warning(
                    "slave %s has fetched from offset %d for %d ms without advancing and is not in sync "
                    "(master durable end %d): it no longer holds back deletion of message-log segments",
                    address, r.acked, now - r.advanced_ms, self._log.flushed_offset,
                )  # fmt: skip
        return min(needed) if needed else None

    def statistics(self) -> SourceStatistics:
        now = self._clock.monotonic_ms()
        durable = self._log.flushed_offset
        replicas = tuple(
            ReplicaProgress(
                address=address,
                acked=r.acked,
                lag_bytes=max(0, durable - r.acked),
                lag_ms=0 if r.acked >= durable else (now - r.caught_up_ms if r.caught_up_ms is not None else -1),
                in_sync=self._is_in_sync(r, now),
                seconds_since_fetch=(now - r.fetched_ms) / 1000,
            )
            for address, r in sorted(self._replicas.items())
            if r.heard
        )
        return SourceStatistics(
            epoch=self.epoch,
            mode=self.mode,
            min_insync=self.min_insync,
            durable_end=durable,
            high_watermark=self.high_watermark(),
            recorded_in_sync=tuple(sorted(self._recorded)),
            fetches=self._fetches,
            bytes_sent=self._bytes_sent,
            resets=self._resets,
            replicas=replicas,
        )

    # -- FETCH ------------------------------------------------------------------------

    async def serve_fetch(self, request: FetchRequest) -> tuple[FetchAnswer, bytes]:
        """Answer one FETCH: acknowledge, check where the logs part, wait for news, send it."""
        # A slave whose log holds a later epoch than this master's followed a newer master: its offsets
        # are that master's, and reading this log there would start mid-record.
        newest = max(request.epoch, request.last_epoch)
        if newest > self.epoch:
            self.on_stale_epoch(newest)
            raise RemoteProtocolError(
                f"FETCH from {request.address} knows epoch {newest} of group {request.group}; this master "
                f"holds epoch {self.epoch}: it was replaced, ask the metaserver for the master",
                code=STALE_EPOCH,
                field="epoch",
                limit=self.epoch,
            )
        self._fetches += 1
        log_ = self._log
        durable = log_.flushed_offset
        split = self._history.end_of(request.last_epoch, durable)
        if request.offset > split:
            return self._answer(request, truncate_to=split), b""
        if request.offset < log_.start_offset:
            raise RemoteProtocolError(
                f"FETCH from {request.address} at offset {request.offset}: this master's message log starts at "
                f"{log_.start_offset} (older segments were filed and deleted). Stop the slave, replace its data "
                "folder with a copy of the master's (taken while the master is stopped) without the copy's "
                "'member' file, and start it again",
                code=OFFSET_DELETED,
                field="offset",
                limit=log_.start_offset,
            )
        self._acknowledge(request, durable)
        reset = request.session != self.session or request.seq < self._journal_first
        if not reset and request.offset >= durable and request.seq >= self._seq:
            news = self._news
            with trio.move_on_after(self._tick_interval_ms / 1000):
                await news.wait()
        durable = log_.flushed_offset
        body = b""
        if request.offset < durable:
            want = min(request.max_bytes, durable - request.offset)
            body, _after = await self._run_blocking(partial(log_.read_raw, request.offset, want))
            self._bytes_sent += len(body)
        reset = reset or request.seq < self._journal_first  # the journal may have moved on meanwhile
        seq = self._seq
        if reset:
            journal = await self._run_blocking(self._snapshot)
            self._resets += 1
        else:
            journal = self._journal[request.seq - self._journal_first :]
        return self._answer(request, journal=journal, reset=reset, seq=seq, durable=durable), body

    def _acknowledge(self, request: FetchRequest, durable: int) -> None:
        now = self._clock.monotonic_ms()
        replica = self._replicas.get(request.address)
        was_in_sync = replica is not None and self._is_in_sync(replica, now)
        if replica is None or not replica.heard:
            # A recorded slave heard from for the first time keeps the grace it was recorded with.
            caught_up = None if replica is None else replica.caught_up_ms
            replica = self._replicas[request.address] = _Replica(request.offset, now, caught_up, advanced_ms=now)
            log.info(
                "slave %s fetches from offset %d (master durable end %d)", request.address, request.offset, durable
            )
        elif request.offset > replica.acked:
            replica.advanced_ms = now
            if replica.stalled:
                replica.stalled = False
                log.info("slave %s advances again (offset %d): it holds back deletion again", request.address,
                         request.offset)  # fmt: skip
        replica.acked = request.offset
        replica.fetched_ms = now
        replica.session, replica.seq = request.session, request.seq
        if request.offset >= durable:
            replica.caught_up_ms = now
        elif replica.answered_ms and request.offset >= replica.answered_durable:
            replica.caught_up_ms = max(replica.caught_up_ms or 0, replica.answered_ms)
        replica.answered_durable, replica.answered_ms = durable, now
        self._wake_waiters()
        self.on_acked()
        if not was_in_sync and self._is_in_sync(replica, now):
            log.info("slave %s is in sync at offset %d", request.address, request.offset)
            self.on_joined_in_sync(request.address)

    def _wake_waiters(self) -> None:
        self._acks.set()
        self._acks = trio.Event()

    def _answer(
        self,
        request: FetchRequest,
        *,
        truncate_to: int | None = None,
        journal: list[bytes] | None = None,
        reset: bool = False,
        seq: int | None = None,
        durable: int | None = None,
    ) -> FetchAnswer:
        return FetchAnswer(
            epoch=self.epoch,
            offset=request.offset,
            durable_end=self._log.flushed_offset if durable is None else durable,
            start_offset=self._log.start_offset,
            history=self._history.entries,
            session=self.session,
            seq=self._seq if seq is None else seq,
            journal=journal or [],
            reset=reset,
            tick=self._tick(),
            now_ms=self._clock.now_ms(),
            truncate_to=truncate_to,
        )

    def _is_in_sync(self, replica: _Replica, now: int) -> bool:
        return (
            now - replica.fetched_ms <= self._lag_ms
            and replica.caught_up_ms is not None
            and now - replica.caught_up_ms <= self._lag_ms
        )


__all__ = ["STRANDED_INTERVALS", "STRANDED_SLAVE_MS", "ReplicaProgress", "ReplicationSource", "SourceStatistics"]
