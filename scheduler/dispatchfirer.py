"""The dispatcher's firer: pops what is due and appends each record to its subject's lane.

It sleeps until the next non-empty millisecond (or a poke) and pops what is due (never
anything later than now). A lane whose SEND returns fires too (``fire_now``, before it
builds its next batch), so while a SEND is on the way the firer sleeps ``fire_slack_ms``
past the next due moment: what falls due meanwhile goes out with the returning lane's next
batch, and the firer's own wake-up (which costs about as much as firing) is mostly saved;
a subject with no SEND on the way is fired at most ``fire_slack_ms`` late for it. One
firing at a time (``_firing``) keeps the firing order within every lane.

A due record that did not check when read (damage on disk, held as ``b""``) is not sent:
it is logged (hour, entry, log byte, why), counted (``damaged``) and recorded done like a
sent one, so its hour finishes and the others go on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import trio

from delaymq.protocol.histogram import LatencyHistogram
from delaymq.protocol.records import record_subject
from delaymq.scheduler.dispatchconfirmer import ConfirmItem
from delaymq.scheduler.dispatchcontext import DispatchContext
from delaymq.scheduler.dispatchlanes import DELIVER_AT, DELIVER_AT_AT, Lane, LaneItem, Lanes
from delaymq.scheduler.hourlog import DamagedRecord, HourLog
from delaymq.scheduler.schedulelog import ScheduleStore
from delaymq.scheduler.wheelset import Due

log = logging.getLogger("delaymq.scheduler.dispatcher")

#: Filters an hour's due ``(deliver_at, entry)`` before they reach a lane (cancels).
Skip = Callable[[int, list[tuple[int, int]]], list[tuple[int, int]]]


class Firer:
    """The firer task (``start``), and the firing the lanes and cancels do through it."""

    def __init__(
        self, context: DispatchContext, *, lanes: Lanes, fire_slack_ms: int, settle: Callable[[], None]
    ) -> None:
        self._store = context.store
        self._wheels = context.wheels
        self._clock = context.clock
        self._wall = context.wall
        self._run_blocking = context.run_blocking
        self._read_ahead = context.read_ahead
        self._lanes = lanes
        self._alarm = context.fire_alarm
        self._load_alarm = context.load_alarm  # poked when a due second is not walked yet
        self._slack_ms = fire_slack_ms
        #: Called after each hand-out: nothing may be on the way any more (``Dispatcher.drain``).
        self._settle = settle
        self._firing = trio.Lock()  # held from popping due entries until they are in their lanes
        self._slacking = False  # the firer sleeps past the next due moment: a SEND is on the way
        self.paused = False
        self.handing_out = 0  # rounds between popping due entries and putting them in lanes
        self.skip: Skip | None = None
        self._nursery: trio.Nursery | None = None  # where lanes run
        self.rounds = 0  # times the firer popped due messages and put them in lanes
        self.reads = 0  # rounds that read records from disk (not read ahead)
        self.damaged = 0  # due records that did not check when read: not sent, recorded done
        #: Fired (put in its lane) - deliver_at of each message: the first stage of its lateness.
        self.lateness_fired = LatencyHistogram()

    def start(self, nursery: trio.Nursery) -> None:
        """Run the firer, and the lanes it fills, in ``nursery``."""
        self._nursery = nursery
        nursery.start_soon(self._run)

    def pause(self) -> None:
        """Fire nothing more until ``resume``."""
        self.paused = True
        self._alarm.poke()

    def resume(self) -> None:
        self.paused = False
        self._alarm.poke()

    async def _run(self) -> None:
        wheels = self._wheels
        wakes = self._lanes.wakes
        while True:
            if self.paused:
                await self._alarm.wait(None)
                continue
            now = self._clock.now_ms()
            if wakes:
                soonest = min(wakes.values())
                if soonest > now:  # a lane waiting out its send interval fires all that is due then
                    await self._slack_until(soonest + self._slack_ms)
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
                self._load_alarm.poke()  # a due second is not walked yet
                wake = None
            elif wake is not None and self._lanes.sends.borrowed_tokens and self._slack_ms:
                # The returning lane fires it first, as a rule; a lane that stops sending pokes.
                await self._slack_until(wake + self._slack_ms)
                continue
            await self._alarm.wait(wake)

    async def _slack_until(self, at: int) -> None:
        """Sleep until ``at`` while a lane fires for the firer (one that stops pokes it)."""
        self._slacking = True
        try:
            await self._alarm.wait(at)
        finally:
            self._slacking = False

    def lane_stopped_sending(self) -> None:
        """A lane's SEND failed or the lane ended: it will not fire for the firer soon."""
        if self._slacking:
            self._alarm.poke()

    async def fire_now(self) -> bool:
        """Fire what is due now unless paused or the firer is at it (then False: it is)."""
        if self.paused:
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

    async def fire_waiting(self) -> None:
        """Fire what is due now, for a lane whose send interval ended: the firer sleeps on
        its word. If the firing is held by a cancel's hand-out (which fires nothing due),
        wait for it and fire here."""
        if not await self.fire_now():
            async with self._firing:
                if not self.paused:
                    await self._fire(self._clock.now_ms())

    async def hand_out(self, due: Due) -> None:
        """Fire these after all (a cancel held them back and its write failed)."""
        async with self._firing:  # not in the middle of another firing: lanes keep their order
            await self._hand_out(due)

    async def _fire(self, now: int) -> bool:
        """Pop what is due at ``now`` and put it in its lanes; False if nothing was due.
        The caller holds ``_firing``: every record fired passes through here."""
        due = self._wheels.pop_due(now)
        if not due:
            return False
        self.rounds += 1
        await self._hand_out(due)
        return True

    async def _hand_out(self, due: Due) -> None:
        """Put each due record in its subject's lane, in firing order."""
        self.handing_out += 1
        try:
            for hour, items in due:
                if self.skip is not None:  # cancelled entries stay out of the lanes (delaymq.scheduler.cancels)
                    kept = self.skip(hour, items)
                    if len(kept) != len(items):
                        keep = {entry for _at, entry in kept}
                        self._read_ahead.forget(hour, [entry for _at, entry in items if entry not in keep])
                    items = kept
                    if not items:
                        continue
                await self._put_in_lanes(hour, items)
        finally:
            self.handing_out -= 1
            self._settle()  # (all of it skipped, or the lanes already took it)

    async def _put_in_lanes(self, hour: int, items: list[tuple[int, int]]) -> None:
        """Append one hour's due records to their lanes, starting a lane for a new subject."""
        read_ahead = self._read_ahead
        cache = read_ahead.records.setdefault(hour, {})
        missing = [entry for _at, entry in items if entry not in cache]
        if missing:  # linked and not read yet, or the cache was full
            await self._read_missing(hour, cache, missing)
        now = self._wall.now_ms()
        lateness: list[int] = []
        late = lateness.append
        asked_at = DELIVER_AT.unpack_from
        lanes = self._lanes.by_subject
        touched: list[Lane] = []
        unsent: list[ConfirmItem] = []
        size = 0
        # Per message: kept inline (no call per record) and on locals.
        for at, entry in items:
            record = cache.pop(entry)
            if not record:  # it did not check when read
                unsent.append(ConfirmItem(at, entry))
                continue
            asked = asked_at(record, DELIVER_AT_AT)[0]  # lateness counts from it if earlier (``due_of``)
            late(now - (asked if 0 < asked < at else at))
            size += len(record)
            subject = record_subject(record)
            lane = lanes.get(subject)
            if lane is None:
                lane = lanes[subject] = Lane(subject)
                touched.append(lane)
            lane.items.append(LaneItem(hour, at, entry, record))
        self.lateness_fired.record_many(lateness)
        read_ahead.records_held -= len(items)
        read_ahead.bytes_held -= size
        self._lanes.waiting += len(items) - len(unsent)
        if unsent:
            self._skip_damaged(hour, unsent)
        nursery = self._nursery
        assert nursery is not None
        for lane in touched:
            nursery.start_soon(self._lanes.run_lane, lane, self)

    def _skip_damaged(self, hour: int, items: list[ConfirmItem]) -> None:
        """Due records that did not check when read: log each, count it, and record it done
        without a send (the confirmer's next round), so its hour finishes."""
        for _at, entry in items:
            damaged = self._read_ahead.take_damaged(hour, entry)
            found = damaged or DamagedRecord(hour, entry, -1, "it did not check when read")
            log.warning("%s; the message is skipped (not sent) and recorded done, the others go on", found)
        self.damaged += len(items)
        self._lanes.confirm_unsent(hour, items)

    async def _read_missing(self, hour: int, cache: dict[int, bytes], missing: list[int]) -> None:
        """Read due records that are not read ahead into ``cache``, through the firer's reader."""
        read_ahead = self._read_ahead
        self.reads += 1
        reading = read_ahead.reading.get(hour)
        if reading:
            reading.difference_update(missing)
        with trio.CancelScope(shield=True):  # a reader opened in the thread must not leak
            reader, records, damaged = await self._run_blocking(
                partial(_read_records, self._store, read_ahead.fire_readers.get(hour), hour, missing)
            )
        read_ahead.fire_readers[hour] = reader
        cache.update(zip(missing, records))
        read_ahead.note_damaged(damaged)
        read_ahead.records_held += len(missing)
        read_ahead.bytes_held += sum(map(len, records))


def _read_records(
    store: ScheduleStore, reader: HourLog | None, hour: int, entries: list[int]
) -> tuple[HourLog, list[bytes], list[DamagedRecord]]:
    """Records due and not in memory, through the firer's own reader of the hour (the
    loader's may be in use in another thread), opened on first need and kept open; those
    that did not check are ``b""``, and said why."""
    damaged: list[DamagedRecord] = []
    if reader is not None:
        return reader, reader.read_records(entries, damaged=damaged), damaged
    reader = store.open_hour(hour)
    try:
        return reader, reader.read_records(entries, damaged=damaged), damaged
    except BaseException:
        reader.close()
        raise


__all__ = ["Firer", "Skip"]
