"""Consumer groups, sans-IO: read positions, pull-log bookkeeping, acks, redelivery.

A **share** is one read position in a subject's consume log: a clustered group's
(all its consumers take the next entries from it) or one broadcast consumer's
(each reads the whole log). A share also holds the messages given back to it, to
be handed out again before new ones, each with one more redelivery.

A **consumer** (of one group, for one subject) has a pull log: the consume-log
sequences it was handed, in order. Its progress is ``AckRanges`` over its pull
log. What it was handed and did not ack goes back to its share when

- the ack timeout passes after the hand-out (``ack_timeout_ms``),
- it stops showing signs of life (pulls and heartbeats; ``consumer_timeout_ms``),
- it nacks it without asking for a retry (or the retry could not be placed).

A consumer may also give back what it never handed to its application (it is
closing; ``release_range``, a NACK with ``release``): back to its share at once
with the same redelivery count, so the message's ``attempts`` stay as they were.
Without an end the release also says the consumer left: a PULL it sent before
(on the connection its pulls came on) that arrives after is handed nothing
(``pulled_after_leaving``), or it would take what the release gave back, for nobody.

A NACK that asks for a retry or a dead letter ``claim``s its range: while the
server re-schedules the messages (a scheduler round trip) nothing else may give
them back; ``release`` then marks them done, or gives them back after all.

This module is fed times and sequences; the server does the file and lmdb I/O.
The times are the monotonic clock's milliseconds (``Clock.monotonic_ms``): every
deadline here is an interval, and a wall-clock step must neither fire every ack
timeout at once nor postpone them by the step.
Deadlines come out in order: hand-outs sit in one deque in hand-out order (the
ack timeout is one constant) and consumers in an ordered dict by last sign of
life, so a sweep costs what it expires, not what is tracked.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from delaymq.protocol.errors import RemoteProtocolError
from delaymq.protocol.ranges import AckRanges

MAX_REDELIVERIES = 0xFFFF


@dataclass(eq=False, slots=True)
class Share:
    """One read position in a consume log, and what was given back to it."""

    key: bytes
    subject: str
    group: str
    broadcast_consumer: str | None  # None for a clustered group's share
    position: int
    redeliver: deque[tuple[int, int]] = field(default_factory=deque)  # (sequence, redeliveries)
    # Sequences past ``position`` a consumer was handed before a crash (restored
    # from its pull log): taking new entries passes over them. Empty but after a
    # crash of a group whose hand-outs had gaps (entries its tag filter skipped).
    skip: set[int] = field(default_factory=set)


@dataclass(eq=False, slots=True)
class ConsumerState:
    """One consumer's pull log as far as bookkeeping needs it."""

    key: bytes
    subject: str
    group: str
    consumer: str
    share: Share
    length: int = 0  # entries in the pull log
    progress: AckRanges = field(default_factory=AckRanges)
    # The pull-log entries from ``window_base`` on (only those can still be undone).
    window_base: int = 0
    sequences: array = field(default_factory=lambda: array("Q"))
    redeliveries: array = field(default_factory=lambda: array("H"))
    last_seen: int = 0
    waiting: int = 0  # pulls parked right now
    live: bool = False
    claimed: list[tuple[int, int]] = field(default_factory=list)  # pull-log ranges being retried
    shipped: int = 0  # pull-log entries put in a progress record (replication) or loaded from lmdb
    # Releases to the end of its pull log (the consumer is closing): a pull of it waiting since
    # before one answers empty, so nothing more is handed to a consumer that left.
    left: int = 0
    # The connection its latest PULL came on, and that one as it left (0: none, or not known).
    pulled_on: int = 0
    left_on: int = 0

    @property
    def broadcast(self) -> bool:
        return self.share.broadcast_consumer is not None

    @property
    def acked(self) -> int:
        return self.progress.acked

    def unacked(self) -> int:
        return sum(end - start for start, end in self.progress.undone(self.progress.acked, self.length))

    def _trim(self) -> None:
        drop = self.progress.acked - self.window_base
        if drop > 64 and drop * 2 >= len(self.sequences):
            del self.sequences[:drop]
            del self.redeliveries[:drop]
            self.window_base += drop


class UnknownPull(RemoteProtocolError):
    """An ack or nack of pull-log entries the consumer was never handed."""


@dataclass(eq=False, slots=True)
class Claim:
    """Nacked pull-log ranges held back while their messages are re-scheduled."""

    consumer: ConsumerState
    ranges: list[tuple[int, int]]  # pull-log ranges
    entries: list[tuple[int, int]]  # (consume-log sequence, redeliveries), in pull-log order


def _subtract(gaps: list[tuple[int, int]], claimed: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``gaps`` without the ``claimed`` ranges (both sorted lists of disjoint ranges)."""
    out: list[tuple[int, int]] = []
    ordered = sorted(claimed)
    for start, end in gaps:
        for claim_start, claim_end in ordered:
            if claim_end <= start or claim_start >= end:
                continue
            if claim_start > start:
                out.append((start, claim_start))
            start = max(start, claim_end)
            if start >= end:
                break
        if start < end:
            out.append((start, end))
    return out


class Groups:
    """Every share and consumer of one server; see the module docstring."""

    def __init__(self, *, ack_timeout_ms: int, consumer_timeout_ms: int) -> None:
        if ack_timeout_ms <= 0 or consumer_timeout_ms <= 0:
            raise ValueError(
                f"ack_timeout_ms ({ack_timeout_ms}) and consumer_timeout_ms ({consumer_timeout_ms}) must be positive"
            )
        self.ack_timeout_ms = ack_timeout_ms
        self.consumer_timeout_ms = consumer_timeout_ms
        self.shares: dict[bytes, Share] = {}
        self.consumers: dict[bytes, ConsumerState] = {}
        self.live: OrderedDict[bytes, ConsumerState] = OrderedDict()
        # (deadline, consumer, start, end): hand-outs in hand-out order.
        self._handed: deque[tuple[int, ConsumerState, int, int]] = deque()
        self.dirty_shares: set[Share] = set()
        self.dirty_consumers: set[ConsumerState] = set()
        self.redelivered = 0  # messages given back to their share, ever
        self.released = 0  # messages a consumer released (never handed to its application), ever
        self.acks = 0  # ACK requests
        self.acked_messages = 0  # pull-log entries an ACK settled (each once)
        self.nacks = 0
        self.pulled_entries = 0  # pull-log entries recorded (hand-outs), ever

    # ---------------------------------------------------------------- members

    def add_share(self, share: Share) -> Share:
        self.shares[share.key] = share
        return share

    def add_consumer(self, consumer: ConsumerState, now: int) -> ConsumerState:
        """Track a consumer (new, or loaded from the state store)."""
        self.consumers[consumer.key] = consumer
        unacked = consumer.progress.undone(consumer.progress.acked, consumer.length)
        if unacked:
            # Loaded with hand-outs in flight (say after a restart): the ack timeout
            # runs from now, since when they were handed out is not kept.
            self._handed.append((now + self.ack_timeout_ms, consumer, unacked[0][0], consumer.length))
        self.touch(consumer, now)
        return consumer

    def touch(self, consumer: ConsumerState, now: int) -> None:
        """A sign of life: a pull or a heartbeat."""
        consumer.last_seen = now
        consumer.live = True
        self.live[consumer.key] = consumer
        self.live.move_to_end(consumer.key)

    def pulled_after_leaving(self, consumer: ConsumerState, connection: int) -> bool:
        """Whether a PULL of ``consumer`` on ``connection`` was sent before it left (then it
        is handed nothing); else ``connection`` is the one its pulls come on from now.

        A consumer stops pulling before it releases to the end of its pull log, and
        closes with its own connections: a PULL on the connection its pulls came on
        then was on its way (its answer reaches nobody). One on another connection is
        a new run under the same consumer id, served as ever.
        """
        if connection and connection == consumer.left_on:
            return True
        consumer.pulled_on = connection
        consumer.left_on = 0
        return False

    # ---------------------------------------------------------------- handing out

    def take_redeliveries(self, share: Share, limit: int) -> list[tuple[int, int]]:
        """Up to ``limit`` given-back messages of ``share``, oldest first."""
        taken: list[tuple[int, int]] = []
        queue = share.redeliver
        while queue and len(taken) < limit:
            taken.append(queue.popleft())
        if taken:
            self.dirty_shares.add(share)
        return taken

    def put_back(self, share: Share, items: list[tuple[int, int]]) -> None:
        """Return taken entries that could not be handed out, at the front, with their counts."""
        share.redeliver.extendleft(reversed(items))
        self.dirty_shares.add(share)

    def advance(self, share: Share, position: int) -> None:
        if position != share.position:
            share.position = position
            self.dirty_shares.add(share)

    def record_pull(self, consumer: ConsumerState, sequences: list[int], redeliveries: list[int], now: int) -> int:
        """Append hand-outs to the consumer's pull log; returns the first pull-log sequence."""
        start = consumer.length
        consumer.sequences.extend(sequences)
        consumer.redeliveries.extend(redeliveries)
        consumer.length += len(sequences)
        self.pulled_entries += len(sequences)
        self._handed.append((now + self.ack_timeout_ms, consumer, start, consumer.length))
        self.dirty_consumers.add(consumer)
        self.touch(consumer, now)
        return start

    # ---------------------------------------------------------------- acks

    def _check_range(self, consumer: ConsumerState | None, start: int, end: int, what: str, names: str) -> None:
        length = consumer.length if consumer is not None else 0
        if not 0 <= start < end:
            raise RemoteProtocolError(
                f"{what} of pull-log range [{start}, {end}) of {names}: a range needs 0 <= start < end",
                code="bad_value",
                field="start" if start < 0 else "end",
            )
        if end > length:
            raise UnknownPull(
                f"{what} of pull-log range [{start}, {end}) of {names}: it was handed only [0, {length})",
                code="unknown_pull",
                field="end",
                limit=length,
            )

    def ack(self, consumer: ConsumerState | None, start: int, end: int, names: str = "the consumer") -> int:
        """Mark ``[start, end)`` acked; returns the acked position.

        Acking again is harmless; a range past what was handed out raises
        ``UnknownPull`` (code ``unknown_pull``) and changes nothing.
        """
        self._check_range(consumer, start, end, "ACK", names)
        if consumer is None:  # pragma: no cover - _check_range refuses any range then
            return 0
        self.acks += 1
        undone = consumer.progress.undone(start, end)
        if undone:
            self.acked_messages += sum(gap_end - gap_start for gap_start, gap_end in undone)
            self.settle(consumer, start, end)
        return consumer.progress.acked

    def nack(
        self, consumer: ConsumerState | None, start: int, end: int, now: int, names: str = "the consumer"
    ) -> tuple[int, list[Share]]:
        """Give the unacked part of ``[start, end)`` back at once; returns (acked, shares woken)."""
        self._check_range(consumer, start, end, "NACK", names)
        if consumer is None:
            return 0, []
        self.nacks += 1
        given = self.return_nacked(consumer, start, end)
        self.touch(consumer, now)
        return consumer.progress.acked, [consumer.share] if given else []

    def return_nacked(self, consumer: ConsumerState, start: int, end: int) -> int:
        """A NACK without a retry: back to its share at once, attempts + 1.

        A NACK that asks for a retry or a dead letter goes through ``claim`` and
        ``release`` instead (the server re-schedules the messages in between).
        """
        return self._give_back(consumer, start, end)

    def release_range(
        self, consumer: ConsumerState | None, start: int, end: int | None, now: int, names: str = "the consumer"
    ) -> tuple[int, list[Share]]:
        """Give the unsettled part of ``[start, end)`` back at once, redeliveries unchanged.

        The consumer never handed those messages to its application, so this is
        not a delivery: no attempt is counted. ``end`` None runs to the end of the
        pull log as this server has it (hand-outs whose answers the consumer never
        read included), ends the consumer's waiting pulls (``left``) and those still
        on their way (``pulled_after_leaving``). Returns (acked, shares that got
        messages back).
        """
        if end is None:
            if consumer is None:
                return 0, []
            consumer.left += 1
            consumer.left_on = consumer.pulled_on
            if start >= consumer.length:  # nothing handed out past what the consumer read
                return consumer.acked, []
            end = consumer.length
        else:
            self._check_range(consumer, start, end, "NACK", names)
        if consumer is None:  # pragma: no cover - _check_range refuses any range then
            return 0, []
        self.nacks += 1
        given = self._give_back(consumer, start, end, attempt=False)
        self.touch(consumer, now)
        return consumer.progress.acked, [consumer.share] if given else []

    def claim(
        self, consumer: ConsumerState | None, start: int, end: int, now: int, names: str = "the consumer"
    ) -> Claim | None:
        """Hold back the unsettled part of ``[start, end)`` for a retry; None when nothing is left.

        Parts claimed already (a repeated NACK while the first is at work) are
        left to the first. Until ``release`` nothing gives the claimed messages
        back: not the ack timeout, not the consumer timeout.
        """
        self._check_range(consumer, start, end, "NACK", names)
        if consumer is None:  # pragma: no cover - _check_range refuses any range then
            return None
        self.nacks += 1
        self.touch(consumer, now)
        gaps = self._unsettled(consumer, start, end)
        if not gaps:
            return None
        base = consumer.window_base
        entries = [
            (consumer.sequences[sequence - base], consumer.redeliveries[sequence - base])
            for gap_start, gap_end in gaps
            for sequence in range(gap_start, gap_end)
        ]
        consumer.claimed.extend(gaps)
        return Claim(consumer, gaps, entries)

    def release(self, claim: Claim, *, done: bool) -> list[Share]:
        """End a claim: ``done`` marks its messages settled (re-scheduled), else they go back at once.

        Returns the shares that got messages back.
        """
        consumer = claim.consumer
        for claimed in claim.ranges:
            consumer.claimed.remove(claimed)
        if not done:
            given = sum(self._give_back(consumer, start, end) for start, end in claim.ranges)
            return [consumer.share] if given else []
        for start, end in claim.ranges:
            self.settle(consumer, start, end)
        return []

    def settle(self, consumer: ConsumerState, start: int, end: int) -> None:
        """Mark pull-log entries ``[start, end)`` done: they will not come back.

        An ack, a claim that was placed, and a hand-out that never reached the
        consumer (a PULL whose records did not check) all end here.
        """
        consumer.progress.mark(start, end)
        consumer._trim()
        self.dirty_consumers.add(consumer)

    def _unsettled(self, consumer: ConsumerState, start: int, end: int) -> list[tuple[int, int]]:
        """The parts of ``[start, end)`` neither settled nor claimed."""
        gaps = consumer.progress.undone(start, end)
        if consumer.claimed and gaps:
            gaps = _subtract(gaps, consumer.claimed)
        return gaps

    def _give_back(self, consumer: ConsumerState, start: int, end: int, *, attempt: bool = True) -> int:
        """Back to the share: with one more redelivery, or (not ``attempt``: a release) as it was."""
        gaps = self._unsettled(consumer, start, end)
        if not gaps:
            return 0
        share = consumer.share
        base = consumer.window_base
        raised = 1 if attempt else 0
        count = 0
        for gap_start, gap_end in gaps:
            for sequence in range(gap_start, gap_end):
                index = sequence - base
                share.redeliver.append(
                    (consumer.sequences[index], min(consumer.redeliveries[index] + raised, MAX_REDELIVERIES))
                )
            consumer.progress.mark(gap_start, gap_end)
            count += gap_end - gap_start
        consumer._trim()
        if attempt:
            self.redelivered += count
        else:
            self.released += count
        self.dirty_shares.add(share)
        self.dirty_consumers.add(consumer)
        return count

    # ---------------------------------------------------------------- lag

    def lag(self, consume_counts: Mapping[str, int]) -> dict[tuple[str, str], int]:
        """Messages each (group, subject) has not acked yet, from ``consume_counts`` (entries per subject).

        A share's lag is what it has yet to take (consume-log end minus its position, less the
        entries consumers were handed past it before a crash), what was given back to it, and
        what its consumers hold unacked (claimed ones included). A broadcast group's lag is its
        slowest consumer's. Consumers not in memory hold nothing unacked (``forget_idle``).
        """
        held: dict[bytes, int] = {}
        for consumer in self.consumers.values():
            unacked = consumer.unacked()
            if unacked:
                held[consumer.share.key] = held.get(consumer.share.key, 0) + unacked
        lag: dict[tuple[str, str], int] = {}
        for share in self.shares.values():
            end = consume_counts.get(share.subject, 0)
            passed = sum(1 for sequence in share.skip if share.position <= sequence < end)
            ahead = max(0, end - share.position - passed)
            count = ahead + len(share.redeliver) + held.get(share.key, 0)
            key = (share.group, share.subject)
            lag[key] = max(lag.get(key, 0), count)
        return lag

    # ---------------------------------------------------------------- time

    def next_deadline(self) -> int | None:
        """The earliest moment ``expire`` may have something to do."""
        deadlines = []
        if self._handed:
            deadlines.append(self._handed[0][0])
        if self.live:
            first = next(iter(self.live.values()))
            deadlines.append(first.last_seen + self.consumer_timeout_ms)
        return min(deadlines) if deadlines else None

    def expire(self, now: int) -> list[Share]:
        """Give back what timed out at ``now``; returns the shares that got messages."""
        woken: dict[bytes, Share] = {}
        handed = self._handed
        while handed and handed[0][0] <= now:
            _deadline, consumer, start, end = handed.popleft()
            if self._give_back(consumer, start, end):
                woken[consumer.share.key] = consumer.share
        live = self.live
        while live:
            consumer = next(iter(live.values()))
            if consumer.last_seen + self.consumer_timeout_ms > now:
                break
            if consumer.waiting:
                self.touch(consumer, now)  # parked in a long poll: alive
                continue
            del live[consumer.key]
            consumer.live = False
            if self._give_back(consumer, consumer.progress.acked, consumer.length):
                woken[consumer.share.key] = consumer.share
        return list(woken.values())

    def forget_idle(self) -> list[bytes]:
        """Drop consumers that are gone, hold nothing and are committed; returns their keys.

        They are reloaded from the state store if they come back.
        """
        idle = [
            key
            for key, consumer in self.consumers.items()
            if not consumer.live and consumer not in self.dirty_consumers and consumer.progress.acked == consumer.length
        ]
        for key in idle:
            del self.consumers[key]
        return idle

    def take_dirty(self) -> tuple[list[Share], list[ConsumerState]]:
        shares, consumers = list(self.dirty_shares), list(self.dirty_consumers)
        self.dirty_shares.clear()
        self.dirty_consumers.clear()
        return shares, consumers


__all__ = ["MAX_REDELIVERIES", "Claim", "ConsumerState", "Groups", "Share", "UnknownPull"]
