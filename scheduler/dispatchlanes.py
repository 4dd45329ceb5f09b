"""The dispatcher's lanes: one per subject with messages on the way, sending them in order.

A lane sends its records in batches (``dispatch_batch`` records, ``dispatch_bytes`` bytes)
through ``deliver`` (SEND on the ``scheduler-delivery`` route: a realtime group for the
subject, other groups tried per call). A failed batch stays at the head of its lane and is
retried with a growing backoff with jitter (capped; an interval of the monotonic clock),
logged once per outage: nothing is dropped and order within a subject holds. A batch is
never sent before the wall clock reads its messages' ``deliver_at``, even if the clock
stepped back after they fired. With ``send_interval_ms`` a lane starts its SENDs at least
that far apart (and stays that long after its last one), firing what fell due in between
into one batch. A lane whose SEND returns fires what fell due meanwhile (``LaneFiring``)
before it builds its next batch. Accepted records go to the ``Confirmer``.
"""

from __future__ import annotations

import logging
import struct
from collections import deque
from collections.abc import Awaitable, Callable
from typing import NamedTuple, Protocol

import trio

from delaymq.protocol.backoff import Backoff, BackoffRun, RandomSource
from delaymq.protocol.records import RECORD_TIMES
from delaymq.scheduler.dispatchconfirmer import Confirmer, ConfirmItem
from delaymq.scheduler.dispatchcontext import DispatchContext

log = logging.getLogger("delaymq.scheduler.dispatcher")

#: Hands one batch (records end to end) of one subject to a realtime server; returns
#: the per-record results once accepted, raises when it was not.
Deliver = Callable[[str, bytes], Awaitable[list[str]]]


#: A message record's ``deliver_at``, at byte ``DELIVER_AT_AT``.
DELIVER_AT = struct.Struct(">q")
DELIVER_AT_AT = 12
_unpack_deliver_at = DELIVER_AT.unpack_from


def due_of(filed_at: int, record: bytes) -> int:
    """When a fired message was due: its record's ``deliver_at``, unless that is not before
    ``filed_at`` (the moment it was filed for). A SCHEDULE received after its moment is filed
    for the time of receipt and keeps its ``deliver_at``: its lateness counts from there."""
    asked = _unpack_deliver_at(record, DELIVER_AT_AT)[0]
    return asked if 0 < asked < filed_at else filed_at


class LaneItem(NamedTuple):
    """One fired record waiting in its subject's lane."""

    hour: int
    deliver_at: int  # the moment it was filed for (its index entry's)
    entry: int
    record: bytes


class Lane:
    """One subject's records on the way, in firing order."""

    __slots__ = ("subject", "name", "items")

    def __init__(self, subject: bytes) -> None:
        self.subject = subject
        self.name = subject.decode()
        self.items: deque[LaneItem] = deque()


class LaneFiring(Protocol):
    """What a lane needs of the firer that started it."""

    async def fire_now(self) -> bool: ...

    async def fire_waiting(self) -> None: ...

    def lane_stopped_sending(self) -> None: ...


class Lanes:
    """The lanes by subject, what they share (SEND slots, backoff, outage) and their counts."""

    def __init__(
        self,
        context: DispatchContext,
        *,
        deliver: Deliver,
        confirmer: Confirmer,
        dispatch_batch: int,
        dispatch_bytes: int,
        max_sends: int,
        backoff_ms: int,
        max_backoff_ms: int,
        send_interval_ms: int,
        send_ahead_ms: int,
        random: RandomSource | None,
    ) -> None:
        self._deliver = deliver
        self._clock = context.clock
        self._wall = context.wall
        self._confirmer = confirmer
        self._batch = dispatch_batch
        self._batch_bytes = dispatch_bytes
        self.sends = trio.CapacityLimiter(max_sends)
        self._send_interval_ms = send_interval_ms
        self._send_ahead_ms = send_ahead_ms
        # "equal" jitter: a lane's retry waits at least half its ceiling (never a tight
        # loop against a realtime server that is down), while the lanes that failed
        # together come back spread out. ``random`` is its source (tests fix it).
        self._backoff = Backoff(initial_ms=backoff_ms, maximum_ms=max_backoff_ms, jitter="equal")
        self._random = random
        self.by_subject: dict[bytes, Lane] = {}
        #: Lanes in a SEND or waiting out their send interval -> when they fire next (wall ms).
        self.wakes: dict[Lane, int] = {}
        self.waiting = 0  # records in lanes, not yet accepted
        self._failing: set[bytes] = set()
        self.outage_since: int | None = None  # monotonic ms
        self._outage_failures = 0
        self.dispatched = 0
        self.batches = 0
        self.failures = 0
        self.lateness_max = 0
        self.lateness_sum = 0

    async def run_lane(self, lane: Lane, firing: LaneFiring) -> None:
        """Send the lane's records in order until it is empty; retry failures, never drop."""
        items = lane.items
        backoff = BackoffRun(self._backoff, random=self._random)
        interval = self._send_interval_ms
        started: int | None = None  # monotonic ms the lane's last SEND started
        try:
            while True:
                if interval and started is not None:
                    await self._wait_out_interval(lane, started, firing)
                if not items:
                    break
                batch, latest, unheld = self._next_batch(items)
                if latest > self._clock.now_ms():
                    # Fired, then the wall clock stepped back (while a retry waited): still
                    # never early by the wall clock.
                    await self._clock.sleep_until_ms(latest)
                    continue
                if not batch:
                    await self._wall.sleep_until_ms(unheld)
                    continue
                started = self._clock.monotonic_ms()
                if not await self._send(lane, batch, firing):
                    # An interval: a wall-clock step must not stretch it.
                    await self._clock.sleep_ms(backoff.next_delay_ms())
                    continue
                backoff.reset()
                if not interval:  # (with one, the lane fires when its wait ends)
                    await firing.fire_now()  # what fell due meanwhile goes in the next batch
        finally:
            self.wakes.pop(lane, None)
            if self.by_subject.get(lane.subject) is lane:
                del self.by_subject[lane.subject]
            firing.lane_stopped_sending()

    async def _wait_out_interval(self, lane: Lane, started: int, firing: LaneFiring) -> None:
        """Wait until ``send_interval_ms`` after the last SEND started, then fire what is due."""
        rest = started + self._send_interval_ms - self._clock.monotonic_ms()
        if rest > 0:  # gather what falls due meanwhile into one batch (the lane stays
            await self._clock.sleep_ms(rest)  # while it waits: its subject keeps the interval)
        self.wakes.pop(lane, None)
        await firing.fire_waiting()

    def _next_batch(self, items: deque[LaneItem]) -> tuple[list[LaneItem], int, int]:
        """The batch at the head of the lane, its latest ``deliver_at``, and the due time
        of the record it stopped at because realtime would not hold it yet (else 0)."""
        ahead = self._send_ahead_ms
        record_times = RECORD_TIMES.unpack_from
        most = self._batch
        most_bytes = self._batch_bytes
        batch: list[LaneItem] = []
        size = 0
        latest = 0
        unheld = 0
        wall_now = self._wall.now_ms() if ahead else 0
        for item in items:
            record = item.record
            length = len(record)
            if batch and (len(batch) >= most or size + length > most_bytes):
                break
            at = item.deliver_at
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
        return batch, latest, unheld

    async def _send(self, lane: Lane, batch: list[LaneItem], firing: LaneFiring) -> bool:
        """SEND ``batch``; True once accepted (then it leaves the lane), False if it failed."""
        count = len(batch)
        body = b"".join([item.record for item in batch])
        interval = self._send_interval_ms
        if interval:  # the lane fires all that is due when its interval ends: the firer need not
            self.wakes[lane] = self._clock.now_ms() + interval
        try:
            async with self.sends:
                results = await self._deliver(lane.name, body)
            if len(results) != count:
                raise ValueError(f"realtime answered {len(results)} results for {count} records")
        except Exception as error:  # anything: the batch stays and is sent again
            self.wakes.pop(lane, None)
            firing.lane_stopped_sending()  # no SEND of this lane returns soon
            self._send_failed(lane, error)
            return False
        items = lane.items
        for _ in range(count):
            items.popleft()
        self._accepted(batch)
        self._send_succeeded(lane)
        return True

    def _accepted(self, batch: list[LaneItem]) -> None:
        now = self._wall.now_ms()
        worst = self.lateness_max
        total = 0
        confirm = self._confirmer.pending
        for hour, at, entry, record in batch:
            late = now - due_of(at, record)
            total += late
            if late > worst:
                worst = late
            pending = confirm.get(hour)
            if pending is None:
                pending = confirm[hour] = []
            pending.append(ConfirmItem(at, entry))
        self.lateness_max = worst
        self.lateness_sum += total
        self.dispatched += len(batch)
        self.waiting -= len(batch)
        self.batches += 1
        self._confirmer.accepted(all_accepted=not self.waiting)

    def confirm_unsent(self, hour: int, items: list[ConfirmItem]) -> None:
        """Record these done without a send (their records did not check): the confirmer's next round."""
        self._confirmer.pending.setdefault(hour, []).extend(items)
        self._confirmer.accepted(all_accepted=not self.waiting)

    def _send_failed(self, lane: Lane, error: Exception) -> None:
        self.failures += 1
        self._failing.add(lane.subject)
        if self.outage_since is None:
            self.outage_since = self._clock.monotonic_ms()
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

    def _send_succeeded(self, lane: Lane) -> None:
        self._failing.discard(lane.subject)
        if self.outage_since is not None and not self._failing:
            log.warning(
                "delivery works again after %d failed attempt(s) over %.1f s",
                self._outage_failures,
                (self._clock.monotonic_ms() - self.outage_since) / 1000,
            )
            self.outage_since = None


__all__ = ["DELIVER_AT", "DELIVER_AT_AT", "Deliver", "Lane", "LaneFiring", "LaneItem", "Lanes", "due_of"]
