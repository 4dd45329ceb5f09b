"""A consumer's pull log on one realtime group, and the acks and nacks taken from it to send.

Per realtime group and subject pulled (the subject, and the group's retry subject
``%retry%<group>%<subject>`` where nacked messages come back) an ``AckTracker``
holds the consumer's pull-log sequences as handed out, the contiguous settled
prefix, and the acked / nacked / released ranges not sent yet: merged, so many
acks travel as a few ``[start, end)`` ranges; nacks kept apart by the retry
delay the ``RetryPolicy`` gives their ``attempts``. Released ranges are messages
never handed to the application (the consumer is closing): the group gets them
back with ``attempts`` unchanged. A ``Settlement`` is what is taken out of one
tracker to send, one ``SettleRequest`` per range.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from delaymq.client.retry import RetryNack
from delaymq.protocol.ranges import AckRanges, RangeSet


class AckTracker:
    """A consumer's pull log on one realtime group, as the client sees it.

    ``acked`` is the contiguous settled prefix (everything below it is acked,
    nacked or filtered); ``end`` the next sequence the server will hand out.
    ``to_ack`` / ``to_nack`` / ``to_release`` are the settled ranges not yet sent
    (``to_nack``: give back at once; ``to_release``: give back, no attempt
    counted); ``to_retry`` the nacked ranges to re-schedule, by what their NACK
    asks for (one NACK carries one delay, so ranges are kept apart by it).
    ``in_doubt``: a PULL went out whose answer was not read (on its way, lost or
    given up), so the server may have handed out more than ``end``;
    ``release_from``: release everything from there to the end of the server's
    pull log (set when the consumer closes in doubt).
    """

    __slots__ = (
        "end", "epoch", "started", "_settled", "to_ack", "to_nack", "to_release", "to_retry", "in_doubt",
        "release_from",
    )  # fmt: skip

    def __init__(self) -> None:
        self.end = 0
        self.epoch = 0
        self.started = False
        self._settled = AckRanges()  # the settled prefix, and settled sequences above it
        self.to_ack = RangeSet()
        self.to_nack = RangeSet()
        self.to_release = RangeSet()
        self.to_retry: dict[RetryNack, RangeSet] = {}
        self.in_doubt = False
        self.release_from: int | None = None

    def handed(self, start: int, count: int, server_acked: int) -> tuple[int, int] | None:
        """Take a PULL answer's ``[start, start + count)``.

        Returns a gap ``[end, start)`` the server handed to this consumer but
        this process never saw (a pull whose answer was lost, or an earlier run
        under the same consumer id); it is queued as a nack so the group gets
        it back at once instead of after the ack timeout.
        """
        if not self.started or start < self.end:
            if self.started:  # the server re-numbered: it lost the tail of our pull log
                self.epoch += 1
                self.to_ack.take()
                self.to_nack.take()
                self.to_release.take()
                self.to_retry.clear()
            self.started = True
            self._settled = AckRanges(min(server_acked, start))
            self.end = self.acked
        gap = None
        if start > self.end:
            gap = (self.end, start)
            self._settled.mark(*gap)
            self.to_nack.add(*gap)
        self.end = max(self.end, start + count)
        return gap

    def settle(self, sequence: int, *, ack: bool, retry: RetryNack | None = None, release: bool = False) -> bool:
        """Mark one sequence acked (or nacked); False if it was settled already or never handed.

        A nack with ``retry`` is re-scheduled as it says; without, given back at once
        (``release``: with no attempt counted, for a message never handed to the application).
        """
        if sequence >= self.end or self._settled.is_done(sequence):
            return False
        self._settled.mark(sequence, sequence + 1)
        if ack:
            self.to_ack.add(sequence, sequence + 1)
        elif release:
            self.to_release.add(sequence, sequence + 1)
        elif retry is None:
            self.to_nack.add(sequence, sequence + 1)
        else:
            self.retry_ranges(retry).add(sequence, sequence + 1)
        return True

    def retry_ranges(self, retry: RetryNack) -> RangeSet:
        ranges = self.to_retry.get(retry)
        if ranges is None:
            ranges = self.to_retry[retry] = RangeSet()
        return ranges

    def take_retries(self) -> list[tuple[RetryNack, list[tuple[int, int]]]]:
        """The retry nacks not sent yet, by what they ask for; the tracker forgets them."""
        taken = [(retry, ranges.take()) for retry, ranges in self.to_retry.items() if ranges]
        self.to_retry.clear()
        return taken

    @property
    def acked(self) -> int:
        """Everything below it is settled."""
        return self._settled.acked

    @property
    def pending(self) -> bool:
        return (
            bool(self.to_ack) or bool(self.to_nack) or bool(self.to_release) or self.release_from is not None
            or any(self.to_retry.values())
        )  # fmt: skip

    def outstanding(self) -> int:
        """Sequences handed out and not settled."""
        return self.end - self.acked - self._settled.done_above()

    def release_unread(self) -> bool:
        """Closing: if a PULL's answer went unread, release from ``end`` on; False when there is
        none, or no answer ever said where this pull log stands."""
        if self.in_doubt and self.started:
            self.release_from = self.end
            return True
        return False

    def unsent(self) -> tuple[int, int, int]:
        """Queued here: (messages not given back, releases to the end (0 or 1), acks)."""
        back = _count(self.to_nack) + _count(self.to_release) + sum(_count(r) for r in self.to_retry.values())
        return back, int(self.release_from is not None), _count(self.to_ack)

    def take_settlement(self, group: str, address: str, subject: str, retry_lane: bool) -> Settlement:
        """Everything not sent yet, taken out to send to ``group`` at ``address``."""
        release_from, self.release_from = self.release_from, None
        return Settlement(
            group, address, self.epoch, self.to_ack.take(), self.to_nack.take(), self.take_retries(), subject,
            retry_lane, self.to_release.take(), release_from,
        )  # fmt: skip

    def put_back(self, unsent: Iterable[SettleRequest]) -> None:
        """Queue again what a failed round did not deliver (of this tracker's epoch)."""
        for request in unsent:
            if request.end is None:
                self.release_from = request.start
            elif request.ack:
                self.to_ack.add(request.start, request.end)
            elif request.release:
                self.to_release.add(request.start, request.end)
            elif request.retry is None:
                self.to_nack.add(request.start, request.end)
            else:
                self.retry_ranges(request.retry).add(request.start, request.end)


def _count(ranges: RangeSet) -> int:
    return sum(end - start for start, end in ranges.ranges())


class SettleRequest(NamedTuple):
    """One ACK or NACK of a pull-log range; a NACK's ``retry`` says what it asks for (None: at once).

    A ``release`` NACK gives back with no attempt counted; its ``end`` may be None: to
    the end of the server's pull log.
    """

    ack: bool
    start: int
    end: int | None
    retry: RetryNack | None = None
    release: bool = False


@dataclass(frozen=True, slots=True)
class Settlement:
    """Acks and nacks to send to one group for one subject (taken from its tracker)."""

    group: str
    address: str
    epoch: int
    acks: list[tuple[int, int]]
    nacks: list[tuple[int, int]]  # give back at once
    retries: list[tuple[RetryNack, list[tuple[int, int]]]] = field(default_factory=list)
    subject: str = ""
    retry_lane: bool = False  # the ranges are of the group's retry subject
    releases: list[tuple[int, int]] = field(default_factory=list)  # give back, no attempt counted
    release_from: int | None = None  # release from here to the end of the server's pull log

    def split_leaving(self) -> tuple[Settlement | None, Settlement]:
        """(the release to the end of the pull log alone, or None; everything else): the first
        is sent, and answered, before the rest (see ``AckSender.send_round``)."""
        if self.release_from is None:
            return None, self
        alone = Settlement(
            self.group, self.address, self.epoch, [], [], subject=self.subject, retry_lane=self.retry_lane,
            release_from=self.release_from,
        )  # fmt: skip
        return alone, replace(self, release_from=None)

    def requests(self) -> list[SettleRequest]:
        """Every request, in sending order: what goes back to the group first (it gets them
        sooner), then acks."""
        out = [SettleRequest(False, start, end, release=True) for start, end in self.releases]
        if self.release_from is not None:
            out.append(SettleRequest(False, self.release_from, None, release=True))
        out += [SettleRequest(False, start, end) for start, end in self.nacks]
        out += [SettleRequest(False, start, end, retry) for retry, ranges in self.retries for start, end in ranges]
        out += [SettleRequest(True, start, end) for start, end in self.acks]
        return out


__all__ = ["AckTracker", "SettleRequest", "Settlement"]
