"""The dispatcher: opens hours, loads seconds, fires due messages, hands them to realtime.

Four kinds of trio task share one ``WheelSet`` (the pure rules) on the event loop;
every disk read or write runs through ``run_blocking`` (a worker thread):

- the **loader** opens due hours (heads table + dispatch log -> ``SecondWheel``), walks
  the chains of seconds about ``load_ahead_ms`` ahead and reads their records into
  memory (bounded by ``max_loaded`` entries and ``max_cached_bytes``), reads the
  records of arrivals linked into seconds already loaded (one thread call for all
  hours, through readers kept open), and closes finished hours;
- the **firer** sleeps until the next non-empty millisecond (or a poke), pops what is
  due (never anything later than now) and appends each record to its subject's lane.
  A lane whose SEND returns fires too (``_fire``, before it builds its next batch), so
  while a SEND is on the way the firer sleeps ``fire_slack_ms`` past the next due
  moment: what falls due meanwhile goes out with the returning lane's next batch,
  and the firer's own wake-up (which costs about as much as firing) is mostly saved;
  a subject with no SEND on the way is fired at most ``fire_slack_ms`` late for it.
  One firing at a time (``_firing``) keeps the firing order within every lane;
- one **lane** per subject with messages on the way sends them in order, in batches
  (``dispatch_batch`` records, ``dispatch_bytes`` bytes) through ``deliver`` (SEND
  on the ``scheduler-delivery`` route: a realtime group for the subject, other groups
  tried per call). A failed batch stays at the head of its lane and is retried with
  a growing backoff with jitter (capped; an interval of the monotonic clock), logged once per
  outage: nothing is dropped and order within a subject holds. A batch is never sent
  before the wall clock reads its messages' ``deliver_at``, even if the clock stepped
  back after they fired. With ``send_interval_ms`` a lane starts its SENDs at least
  that far apart (and stays that long after its last one), firing what fell due in
  between into one batch: fewer SENDs for up to that much more lateness. With
  ``send_ahead_ms`` the loader, firer and lanes run on the wall clock read that much
  early (``AheadClock``): each message is sent that long before its ``deliver_at``, and
  realtime holds it until then (``delaymq.realtime.delivery.pick``), so the SEND's round
  trip, the interval and the firer's delays come before the moment instead of after it;
- the **confirmer** records what realtime accepted in the hours' dispatch logs (one
  thread call and one fsync per round; while more is on the way, rounds start at least
  ``confirm_interval_ms`` apart, so one round covers the SENDs accepted meanwhile) and
  only then marks it done in the wheel, which moves the tick and frees the memory budget.

Docs: docs/scheduler.md.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from functools import partial
from typing import Any

import trio

from delaymq.clock import AheadClock, Alarm, Clock
from delaymq.protocol.backoff import Backoff, BackoffRun, RandomSource
from delaymq.protocol.histogram import LatencyHistogram
from delaymq.protocol.records import RECORD_TIMES, record_subject
from delaymq.scheduler.delayindex import Heads
from delaymq.scheduler.hourlog import HourLog
from delaymq.scheduler.schedulelog import ScheduleStore
from delaymq.scheduler.wheelset import Due, Load, WheelSet
from delaymq.storage.threads import RunBlocking

log = logging.getLogger(__name__)

#: Hands one batch (records end to end) of one subject to a realtime server; returns
#: the per-record results once accepted, raises when it was not.
Deliver = Callable[[str, bytes], Awaitable[list[str]]]

DEFAULT_DISPATCH_BATCH = 1_000
DEFAULT_DISPATCH_BYTES = 4 << 20
DEFAULT_MAX_CACHED_BYTES = 256 << 20
DEFAULT_MAX_SENDS = 16
DEFAULT_BACKOFF_MS = 100
DEFAULT_MAX_BACKOFF_MS = 5_000
#: While records are on their way, dispatch-log rounds start at least this far apart: a
#: round's thread hand-off and fsync cost more than its entries. The tick (replicated every
#: 50 ms) lags by at most this; once everything fired is accepted the round starts at once.
DEFAULT_CONFIRM_INTERVAL_MS = 10
#: While a SEND is on the way the firer wakes this long after the next due moment (the
#: returning lane fires first, as a rule).
DEFAULT_FIRE_SLACK_MS = 2
#: A lane starts its SENDs at least this far apart (monotonic ms): what falls due in
#: between goes in one batch, so SENDs (and realtime's fsyncs and the consumers' PULLs
#: they cause) follow this rate rather than the SEND round trip. 0: no wait.
DEFAULT_SEND_INTERVAL_MS = 0
#: The firer fires each message this long before its ``deliver_at`` (realtime stores it
#: at once and hands it out from ``deliver_at``), so the SEND's round trip and the firer's
#: own delays are spent before the moment. 0: fire at the moment.
DEFAULT_SEND_AHEAD_MS = 0
#: At most this far ahead (a realtime server refuses a ``deliver_at`` over a minute ahead;
#: a message fired ahead can no longer be cancelled).
MAX_SEND_AHEAD_MS = 10_000


@dataclass(frozen=True, slots=True)
class DispatcherStatistics:
    dispatched: int  # records a realtime server accepted
    batches: int  # SEND requests accepted
    failures: int  # SEND requests that failed (each retried)
    recorded: int  # entries newly written to dispatch logs
    lateness_max_ms: int  # accepted - deliver_at, worst since start (overdue restarts included)
    lateness_mean_ms: float
    lanes: int  # subjects with messages on the way
    waiting: int  # records in lanes, not yet accepted
    cached_records: int  # records read ahead, not yet due
    cached_bytes: int
    delivered_held: int  # entry numbers of the open hours delivered before a restart, not loaded yet
    in_outage: bool  # some subject's delivery is failing right now
    hours_opened: int
    seconds_loaded: int
    fire_rounds: int  # times the firer popped due messages and put them in lanes
    confirm_rounds: int  # dispatch-log rounds (one thread call and one flush each)
    fire_reads: int  # fire rounds that read records from disk (not in memory: due at once, or over budget)
    lateness_fired: dict[str, Any]  # fired - deliver_at per message, ms (``LatencyHistogram.to_wire``)


class _Lane:
    """One subject's records on the way, in firing order."""

    __slots__ = ("subject", "name", "items")

    def __init__(self, subject: bytes) -> None:
        self.subject = subject
        self.name = subject.decode()
        self.items: deque[tuple[int, int, int, bytes]] = deque()  # hour, deliver_at, entry, record


class Dispatcher:
    """Fires the ``WheelSet``'s due messages through ``deliver``. Run it with ``run``."""

    def __init__(
        self,
        *,
        store: ScheduleStore,
        wheels: WheelSet,
        deliver: Deliver,
        clock: Clock,
        run_blocking: RunBlocking,
        dispatch_batch: int = DEFAULT_DISPATCH_BATCH,
        dispatch_bytes: int = DEFAULT_DISPATCH_BYTES,
        max_cached_bytes: int = DEFAULT_MAX_CACHED_BYTES,
        max_sends: int = DEFAULT_MAX_SENDS,
        backoff_ms: int = DEFAULT_BACKOFF_MS,
        max_backoff_ms: int = DEFAULT_MAX_BACKOFF_MS,
        confirm_interval_ms: int = DEFAULT_CONFIRM_INTERVAL_MS,
        fire_slack_ms: int = DEFAULT_FIRE_SLACK_MS,
        send_interval_ms: int = DEFAULT_SEND_INTERVAL_MS,
        send_ahead_ms: int = DEFAULT_SEND_AHEAD_MS,
        random: RandomSource | None = None,
        on_recorded: Callable[[dict[int, list[int]]], None] | None = None,
    ) -> None:
        for name, value in (
            ("dispatch_batch", dispatch_batch),
            ("dispatch_bytes", dispatch_bytes),
            ("max_sends", max_sends),
            ("backoff_ms", backoff_ms),
        ):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        for name, value in (
            ("confirm_interval_ms", confirm_interval_ms),
            ("fire_slack_ms", fire_slack_ms),
            ("send_interval_ms", send_interval_ms),
            ("send_ahead_ms", send_ahead_ms),
        ):
            if value < 0:
                raise ValueError(f"{name} must be at least 0, got {value}")
        if max_backoff_ms < backoff_ms:
            raise ValueError(f"max_backoff_ms ({max_backoff_ms}) must be at least backoff_ms ({backoff_ms})")
        self.store = store
        self.wheels = wheels
        self._deliver = deliver
        #: The wall clock, for what is measured against ``deliver_at`` (lateness).
        self._wall = clock
        #: What the loader, firer and lanes run on: the wall clock read ``send_ahead_ms`` early.
        self._clock: Clock = AheadClock(clock, send_ahead_ms) if send_ahead_ms else clock
        self.send_ahead_ms = send_ahead_ms
        self._run_blocking = run_blocking
        self._batch = dispatch_batch
        self._batch_bytes = dispatch_bytes
        self._max_cached_bytes = max_cached_bytes
        self._sends = trio.CapacityLimiter(max_sends)
        self._confirm_interval_ms = confirm_interval_ms
        self._fire_slack_ms = fire_slack_ms
        self._send_interval_ms = send_interval_ms
        #: Lanes in a SEND or waiting out their send interval -> when they fire next (wall ms).
        self._lane_wakes: dict[_Lane, int] = {}
        self._firing = trio.Lock()  # held from popping due entries until they are in their lanes
        self._slacking = False  # the firer sleeps past the next due moment: a SEND is on the way
        # "equal" jitter: a lane's retry waits at least half its ceiling (never a tight
        # loop against a realtime server that is down), while the lanes that failed
        # together come back spread out. ``random`` is its source (tests fix it).
        self._backoff = Backoff(initial_ms=backoff_ms, maximum_ms=max_backoff_ms, jitter="equal")
        self._random = random
        #: Told of each confirmer round once it is durable: hour -> entry numbers (replication).
        self._on_recorded = on_recorded
        self._paused = False
        self._confirming = False
        self._handing_out = 0  # firer rounds between popping due entries and putting them in lanes
        #: Set once nothing is on the way (``_settle``): what ``drain`` waits for.
        self._settled: trio.Event | None = None
        #: Filters each hour's due ``(deliver_at, entry)`` before they reach a lane (cancels).
        self.skip: Callable[[int, list[tuple[int, int]]], list[tuple[int, int]]] | None = None
        self.load_alarm = Alarm(self._clock)
        self.fire_alarm = Alarm(self._clock)
        self._confirm_alarm = Alarm(self._clock)
        #: The confirmer's pause between rounds: poked when nothing is on the way.
        self._gather_alarm = Alarm(self._clock)
        self._gathering = False
        self._readers: dict[int, HourLog] = {}  # the loader's, per open hour
        self._fire_readers: dict[int, HourLog] = {}  # the firer's, opened when it must read
        self._reading: dict[int, set[int]] = {}  # linked entries the loader is reading; the firer drops fired ones
        self._cache: dict[int, dict[int, bytes]] = {}  # hour -> entry -> record, read ahead
        self._cached_bytes = 0
        self._cached_records = 0
        self._lanes: dict[bytes, _Lane] = {}
        self._waiting = 0
        self._to_confirm: dict[int, list[tuple[int, int]]] = {}
        self._failing: set[bytes] = set()
        self._outage_since: int | None = None  # monotonic ms
        self._outage_failures = 0
        self._nursery: trio.Nursery | None = None
        self._dispatched = 0
        self._batches = 0
        self._failures = 0
        self.recorded = 0
        self._lateness_max = 0
        self._lateness_sum = 0
        self._hours_opened = 0
        self._seconds_loaded = 0
        self._fire_rounds = 0
        self._confirm_rounds = 0
        self._fire_reads = 0
        #: Fired (put in its lane) - deliver_at of each message: the first stage of its lateness.
        self.lateness_fired = LatencyHistogram()

    # ------------------------------------------------------------------ running

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Load, fire, send and confirm until cancelled."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._load_loop)
                nursery.start_soon(self._fire_loop)
                nursery.start_soon(self._confirm_loop)
                task_status.started()
        finally:
            for readers in (self._readers, self._fire_readers):
                for reader in readers.values():
                    reader.close()
                readers.clear()

    def poke(self) -> None:
        """Something arrived (or changed): both sleepers work out their next moment again."""
        self.load_alarm.poke()
        self.fire_alarm.poke()

    async def drain(self) -> None:
        """Fire nothing more; return once everything handed out is accepted and recorded
        (a graceful handover: the slave taking over then holds every dispatch record)."""
        self._paused = True
        self.fire_alarm.poke()
        while self._on_the_way():
            self._settled = trio.Event()
            self._confirm_alarm.poke()
            if self._gathering:  # the confirmer's pause ends: no more is coming
                self._gather_alarm.poke()
            await self._settled.wait()
        self._settled = None

    def _on_the_way(self) -> bool:
        """Records are being handed out, wait in lanes, or are not yet recorded."""
        return bool(self._handing_out or self._waiting or self._to_confirm or self._confirming)

    def _settle(self) -> None:
        """Wake ``drain`` if nothing is on the way now (called where that may have become so)."""
        if self._settled is not None and not self._on_the_way():
            self._settled.set()

    def resume(self) -> None:
        """Fire again after ``drain`` (a handover that did not happen)."""
        self._paused = False
        self.fire_alarm.poke()
        self.load_alarm.poke()

    def statistics(self) -> DispatcherStatistics:
        accepted = self._dispatched
        return DispatcherStatistics(
            dispatched=accepted,
            batches=self._batches,
            failures=self._failures,
            recorded=self.recorded,
            lateness_max_ms=self._lateness_max,
            lateness_mean_ms=self._lateness_sum / accepted if accepted else 0.0,
            lanes=len(self._lanes),
            waiting=self._waiting,
            cached_records=self._cached_records,
            cached_bytes=self._cached_bytes,
            delivered_held=self.wheels.delivered_held(),
            in_outage=self._outage_since is not None,
            hours_opened=self._hours_opened,
            seconds_loaded=self._seconds_loaded,
            fire_rounds=self._fire_rounds,
            confirm_rounds=self._confirm_rounds,
            fire_reads=self._fire_reads,
            lateness_fired=self.lateness_fired.to_wire(),
        )

    # ------------------------------------------------------------------ loader

    async def _load_loop(self) -> None:
        wheels = self.wheels
        while True:
            now = self._clock.now_ms()
            for hour in wheels.hours_to_close(now):
                self._close_hour(hour)
            opening = wheels.hours_to_open(now)
            for hour in opening:
                await self._open_hour(hour)
            linked = wheels.take_linked()
            if linked:
                await self._read_linked(linked)
            loads = wheels.seconds_to_load(self._clock.now_ms())
            if loads:
                await self._load(loads)
                self.fire_alarm.poke()
                continue
            if opening:
                self.fire_alarm.poke()
                continue
            await self.load_alarm.wait(wheels.next_load_ms(self._clock.now_ms()))

    async def _open_hour(self, hour: int) -> None:
        self.wheels.begin_open(hour)
        try:
            with trio.CancelScope(shield=True):  # a reader opened in the thread must not leak
                reader, heads, delivered = await self._run_blocking(partial(_read_hour, self.store, hour))
        except BaseException:
            self.wheels.open_failed(hour)
            raise
        self._readers[hour] = reader
        self._cache.setdefault(hour, {})
        self.wheels.opened(hour, heads.counts, heads.entries, delivered)
        self._hours_opened += 1
        if delivered:
            log.info(
                "hour %s: %d of %d entries were delivered before; skipping them",
                reader.name,
                len(delivered),
                heads.entries,
            )

    def _close_hour(self, hour: int) -> None:
        self.wheels.close(hour)
        for readers in (self._readers, self._fire_readers):
            reader = readers.pop(hour, None)
            if reader is not None:
                reader.close()
        cache = self._cache.pop(hour, None)
        if cache:  # normally empty by now: every entry read ahead was handed out
            self._cached_records -= len(cache)
            self._cached_bytes -= sum(map(len, cache.values()))

    async def _load(self, loads: list[Load]) -> None:
        """Walk the chains of ``loads`` (one thread call per hour) and read their records."""
        by_hour: dict[int, list[Load]] = {}
        for load in loads:
            by_hour.setdefault(load.hour, []).append(load)
        for hour, group in by_hour.items():
            reader = self._readers[hour]
            with_records = self._cached_bytes < self._max_cached_bytes
            self.wheels.begin_load(group)
            try:
                chains, records = await self._run_blocking(
                    # The wheel's delivered set: only this (loader) task changes it, in
                    # ``loaded`` below, so the thread may read it while we wait.
                    partial(_walk, reader, group, self.wheels.delivered(hour), with_records)
                )
            except BaseException:
                for load in group:
                    self.wheels.load_failed(load)
                raise
            for i, (load, chain) in enumerate(zip(group, chains)):
                try:
                    self.wheels.loaded(load, chain)
                except BaseException:
                    for rest in group[i + 1 :]:
                        self.wheels.load_failed(rest)
                    raise
            self._seconds_loaded += len(group)
            if records:
                self._cache[hour].update(records)
                self._cached_records += len(records)
                self._cached_bytes += sum(map(len, records.values()))

    async def _read_linked(self, linked: dict[int, list[int]]) -> None:
        """Read the records of arrivals linked into loaded seconds (one thread call), so
        the firer finds them in memory. Within the cache budget; what is not read here
        (or is fired before the read ends) the firer reads itself."""
        if self._cached_bytes >= self._max_cached_bytes:
            return
        wanted: dict[int, list[int]] = {}
        for hour, entries in linked.items():
            cache = self._cache.get(hour)
            if cache is None or hour not in self._readers:
                continue
            missing = [entry for entry in entries if entry not in cache]
            if missing:
                wanted[hour] = missing
        if not wanted:
            return
        self._reading = reading = {hour: set(entries) for hour, entries in wanted.items()}
        try:
            got = await self._run_blocking(partial(_read_many, {hour: self._readers[hour] for hour in wanted}, wanted))
        finally:
            self._reading = {}
        for hour, records in got.items():
            still = reading[hour]  # not fired meanwhile
            cache = self._cache[hour]
            size = count = 0
            for entry, record in zip(wanted[hour], records):
                if entry in still:
                    cache[entry] = record
                    size += len(record)
                    count += 1
            self._cached_records += count
            self._cached_bytes += size

    # ------------------------------------------------------------------ firer

    async def _fire_loop(self) -> None:
        wheels = self.wheels
        while True:
            if self._paused:
                await self.fire_alarm.wait(None)
                continue
            now = self._clock.now_ms()
            if self._lane_wakes:
                soonest = min(self._lane_wakes.values())
                if soonest > now:  # a lane waiting out its send interval fires all that is due then
                    await self._slack_until(soonest + self._fire_slack_ms)
                    continue
            try:
                self._firing.acquire_nowait()  # no checkpoints when it is free (nearly always)
            except trio.WouldBlock:
                await self._firing.acquire()
            try:
                fired = await self._fire(now)
            finally:
                self._firing.release()
            if fired:
                continue
            wake = wheels.next_due_ms()
            if wake is not None and wake <= now:
                self.load_alarm.poke()  # a due second is not walked yet
                wake = None
            elif wake is not None and self._sends.borrowed_tokens and self._fire_slack_ms:
                # The returning lane fires it first, as a rule; a lane that stops sending pokes.
                await self._slack_until(wake + self._fire_slack_ms)
                continue
            await self.fire_alarm.wait(wake)

    async def _slack_until(self, at: int) -> None:
        """Sleep until ``at`` while a lane fires for the firer (one that stops pokes it)."""
        self._slacking = True
        try:
            await self.fire_alarm.wait(at)
        finally:
            self._slacking = False

    async def hand_out(self, due: Due) -> None:
        """Fire these after all (a cancel held them back and its write failed)."""
        async with self._firing:  # not in the middle of another firing: lanes keep their order
            await self._hand_out(due)

    async def _fire(self, now: int) -> bool:
        """Pop what is due at ``now`` and put it in its lanes; False if nothing was due.
        The caller holds ``_firing``: every record fired passes through here."""
        due = self.wheels.pop_due(now)
        if not due:
            return False
        self._fire_rounds += 1
        await self._hand_out(due)
        return True

    async def _hand_out(self, due: Due) -> None:
        """Put each due record in its subject's lane, in firing order."""
        self._handing_out += 1
        try:
            await self._hand_out_hours(due)
        finally:
            self._handing_out -= 1
            self._settle()  # (all of it skipped, or the lanes already took it)

    async def _hand_out_hours(self, due: Due) -> None:
        for hour, items in due:
            if self.skip is not None:  # cancelled entries stay out of the lanes (delaymq.scheduler.cancels)
                kept = self.skip(hour, items)
                if len(kept) != len(items):
                    self._forget_records(hour, items, kept)
                items = kept
                if not items:
                    continue
            cache = self._cache.setdefault(hour, {})
            missing = [entry for _at, entry in items if entry not in cache]
            if missing:  # linked and not read yet, or the cache was full
                self._fire_reads += 1
                reading = self._reading.get(hour)
                if reading:
                    reading.difference_update(missing)
                with trio.CancelScope(shield=True):  # a reader opened in the thread must not leak
                    reader, records = await self._run_blocking(
                        partial(_read_records, self.store, self._fire_readers.get(hour), hour, missing)
                    )
                self._fire_readers[hour] = reader
                cache.update(zip(missing, records))
                self._cached_records += len(missing)
                self._cached_bytes += sum(map(len, records))
            now = self._wall.now_ms()
            self.lateness_fired.record_many([now - at for at, _entry in items])
            lanes = self._lanes
            touched: list[_Lane] = []
            size = 0
            for at, entry in items:
                record = cache.pop(entry)
                size += len(record)
                subject = record_subject(record)
                lane = lanes.get(subject)
                if lane is None:
                    lane = lanes[subject] = _Lane(subject)
                    touched.append(lane)
                lane.items.append((hour, at, entry, record))
            self._cached_records -= len(items)
            self._cached_bytes -= size
            self._waiting += len(items)
            assert self._nursery is not None
            for lane in touched:
                self._nursery.start_soon(self._run_lane, lane)

    def _forget_records(self, hour: int, items: list[tuple[int, int]], kept: list[tuple[int, int]]) -> None:
        """Drop the read-ahead records of due entries held back from the lanes (cancelled,
        or parked while their cancel is written: one fired after all is read again)."""
        keep = {entry for _at, entry in kept}
        dropped = [entry for _at, entry in items if entry not in keep]
        reading = self._reading.get(hour)
        if reading:
            reading.difference_update(dropped)
        cache = self._cache.get(hour)
        if not cache:
            return
        size = count = 0
        for entry in dropped:
            record = cache.pop(entry, None)
            if record is not None:
                size += len(record)
                count += 1
        self._cached_records -= count
        self._cached_bytes -= size

    # ------------------------------------------------------------------ lanes

    async def _run_lane(self, lane: _Lane) -> None:
        """Send the lane's records in order until it is empty; retry failures, never drop."""
        items = lane.items
        backoff = BackoffRun(self._backoff, random=self._random)
        interval = self._send_interval_ms
        ahead = self.send_ahead_ms
        record_times = RECORD_TIMES.unpack_from
        started = None  # monotonic ms the lane's last SEND started
        try:
            while True:
                if interval and started is not None:
                    rest = started + interval - self._clock.monotonic_ms()
                    if rest > 0:  # gather what falls due meanwhile into one batch (the lane stays
                        await self._clock.sleep_ms(rest)  # while it waits: its subject keeps the interval)
                    self._lane_wakes.pop(lane, None)
                    if not await self._fire_now():  # held by a cancel's hand-out, which fires nothing due:
                        async with self._firing:  # the firer sleeps on this lane's word, so fire here
                            if not self._paused:
                                await self._fire(self._clock.now_ms())
                if not items:
                    break
                batch: list[tuple[int, int, int, bytes]] = []
                size = 0
                latest = 0
                unheld = 0  # the due time of a record realtime would not hold, not due yet
                wall_now = self._wall.now_ms() if ahead else 0
                for item in items:
                    record = item[3]
                    length = len(record)
                    if batch and (len(batch) >= self._batch or size + length > self._batch_bytes):
                        break
                    at = item[1]
                    if ahead and at > wall_now and record_times(record)[6] >= at:
                        # Realtime holds a record sent ahead only if it was created before it
                        # is due (how it tells one from an immediate one): this one (and what
                        # follows it) goes at its moment by the wall clock; what is before it, now.
                        unheld = at
                        break
                    batch.append(item)
                    size += length
                    if at > latest:
                        latest = at
                if latest > self._clock.now_ms():
                    # Fired, then the wall clock stepped back (while a retry waited): still
                    # never early by the wall clock.
                    await self._clock.sleep_until_ms(latest)
                    continue
                if not batch:
                    await self._wall.sleep_until_ms(unheld)
                    continue
                count = len(batch)
                body = b"".join(item[3] for item in batch)
                started = self._clock.monotonic_ms()
                if interval:  # the lane fires all that is due when its interval ends: the firer need not
                    self._lane_wakes[lane] = self._clock.now_ms() + interval
                try:
                    async with self._sends:
                        results = await self._deliver(lane.name, body)
                    if len(results) != count:
                        raise ValueError(f"realtime answered {len(results)} results for {count} records")
                except Exception as error:  # anything: the batch stays and is sent again
                    self._lane_wakes.pop(lane, None)
                    if self._slacking:
                        self.fire_alarm.poke()  # no SEND of this lane returns soon
                    self._send_failed(lane, error)
                    # An interval: a wall-clock step must not stretch it.
                    await self._clock.sleep_ms(backoff.next_delay_ms())
                    continue
                for _ in range(count):
                    items.popleft()
                backoff.reset()
                self._accepted(batch)
                self._send_succeeded(lane)
                if not interval:  # (with one, the lane fires when its wait ends)
                    await self._fire_now()  # what fell due meanwhile goes in the next batch
        finally:
            self._lane_wakes.pop(lane, None)
            if self._lanes.get(lane.subject) is lane:
                del self._lanes[lane.subject]
            if self._slacking:
                self.fire_alarm.poke()  # no SEND of this lane returns soon

    async def _fire_now(self) -> bool:
        """Fire what is due now unless paused or the firer is at it (then False: it is)."""
        if self._paused:
            return True
        try:
            self._firing.acquire_nowait()
        except trio.WouldBlock:
            return False
        try:
            await self._fire(self._clock.now_ms())
        finally:
            self._firing.release()
        return True

    def _accepted(self, batch: list[tuple[int, int, int, bytes]]) -> None:
        now = self._wall.now_ms()
        worst = self._lateness_max
        total = 0
        confirm = self._to_confirm
        for hour, at, entry, _record in batch:
            late = now - at
            total += late
            if late > worst:
                worst = late
            pending = confirm.get(hour)
            if pending is None:
                pending = confirm[hour] = []
            pending.append((at, entry))
        self._lateness_max = worst
        self._lateness_sum += total
        self._dispatched += len(batch)
        self._waiting -= len(batch)
        self._batches += 1
        self._confirm_alarm.poke()
        if not self._waiting and self._gathering:
            self._gather_alarm.poke()  # everything fired is accepted: no need to wait for more

    def _send_failed(self, lane: _Lane, error: Exception) -> None:
        self._failures += 1
        self._failing.add(lane.subject)
        if self._outage_since is None:
            self._outage_since = self._clock.monotonic_ms()
            self._outage_failures = 0
            log.warning(
                "delivery of subject %r failed (%s: %s); retrying with backoff up to %d ms, nothing is dropped",
                lane.name,
                type(error).__name__,
                error,
                self._backoff.maximum_ms,
            )
        else:
            log.debug("delivery of subject %r failed again: %s", lane.name, error)
        self._outage_failures += 1

    def _send_succeeded(self, lane: _Lane) -> None:
        self._failing.discard(lane.subject)
        if self._outage_since is not None and not self._failing:
            log.warning(
                "delivery works again after %d failed attempt(s) over %.1f s",
                self._outage_failures,
                (self._clock.monotonic_ms() - self._outage_since) / 1000,
            )
            self._outage_since = None

    # ------------------------------------------------------------------ confirmer

    async def _confirm_loop(self) -> None:
        while True:
            await self._confirm_alarm.wait(None)
            while self._to_confirm:
                started = self._clock.monotonic_ms()
                batch, self._to_confirm = self._to_confirm, {}
                self._confirm_rounds += 1
                self._confirming = True
                try:
                    self.recorded += await self._run_blocking(partial(_record, self.store, batch))
                finally:
                    self._confirming = False
                if self._on_recorded is not None:
                    self._on_recorded({hour: [entry for _at, entry in items] for hour, items in batch.items()})
                wheels = self.wheels
                finished = False
                for hour, items in batch.items():
                    wheels.confirm(hour, items)
                    wheel = wheels.wheel(hour)
                    finished = finished or (wheel is not None and wheel.is_done())
                if finished or wheels.short_of_budget:
                    self.load_alarm.poke()  # an hour to close, or memory freed for loads that wait
                self._settle()
                # More on its way: what realtime accepts meanwhile waits for the next round.
                rest = self._confirm_interval_ms - (self._clock.monotonic_ms() - started)
                if rest > 0 and self._waiting and not self._paused:
                    self._gathering = True
                    try:
                        await self._gather_alarm.wait_ms(rest)
                    finally:
                        self._gathering = False


# ---------------------------------------------------------------------- blocking parts


def _read_hour(store: ScheduleStore, hour: int) -> tuple[HourLog, Heads, set[int]]:
    """Open a reader of ``hour``, its heads snapshot and its delivered set (in a thread)."""
    reader = store.open_hour(hour)
    try:
        heads = reader.heads()
        delivered = store.delivered(hour)
    except BaseException:
        reader.close()
        raise
    return reader, heads, delivered


def _walk(
    reader: HourLog, loads: list[Load], skip: AbstractSet[int], with_records: bool
) -> tuple[list[list[tuple[int, int]]], dict[int, bytes]]:
    """Walk each second's chain; read the records of entries not delivered yet."""
    chains = [reader.chain(load.second, below=load.below, floor=load.floor) for load in loads]
    if not with_records:
        return chains, {}
    if skip:
        wanted = [entry for chain in chains for _ms, entry in chain if entry not in skip]
    else:
        wanted = [entry for chain in chains for _ms, entry in chain]
    return chains, dict(zip(wanted, reader.read_records(wanted)))


def _read_many(readers: dict[int, HourLog], wanted: dict[int, list[int]]) -> dict[int, list[bytes]]:
    """The records of ``wanted`` entries, per hour, through the loader's readers."""
    return {hour: readers[hour].read_records(entries) for hour, entries in wanted.items()}


def _read_records(
    store: ScheduleStore, reader: HourLog | None, hour: int, entries: list[int]
) -> tuple[HourLog, list[bytes]]:
    """Records due and not in memory, through the firer's own reader of the hour (the
    loader's may be in use in another thread), opened on first need and kept open."""
    if reader is not None:
        return reader, reader.read_records(entries)
    reader = store.open_hour(hour)
    try:
        return reader, reader.read_records(entries)
    except BaseException:
        reader.close()
        raise


def _record(store: ScheduleStore, batch: dict[int, list[tuple[int, int]]]) -> int:
    """Append accepted entries to their dispatch logs and fsync them: one round."""
    new = 0
    for hour, items in batch.items():
        new += store.record_dispatched(hour, [entry for _at, entry in items])
    store.flush_dispatched()
    return new


__all__ = [
    "DEFAULT_DISPATCH_BATCH",
    "DEFAULT_DISPATCH_BYTES",
    "DEFAULT_SEND_AHEAD_MS",
    "DEFAULT_SEND_INTERVAL_MS",
    "MAX_SEND_AHEAD_MS",
    "Deliver",
    "Dispatcher",
    "DispatcherStatistics",
]
