"""The consumer's sans-IO core: what to pull, what arrived, what to ack.

``ConsumerCore`` holds every decision of a consumer, fed PULL answers and
times; ``Consumer`` (trio) only moves bytes around it (``BlockingConsumer``
runs that same ``Consumer`` on a loop thread). Its parts:

- per realtime group (``GroupLink``, ``delaymq.client.links``) and subject pulled
  (the subject, and the group's retry subject ``%retry%<group>%<subject>`` where
  nacked messages come back) an ``AckTracker`` (``delaymq.client.acks``): the pull
  log as handed out and the acks, nacks and releases not sent yet;
- a ``TagFilter``, ``FlowControl`` and ``PullLimit`` (``delaymq.client.flow``): the
  exact tag check the server's bitmask only narrows, the caps on what is held, and
  the most the consumer pulls in all (``limit``);
- the messages it hands out, ``ReceivedMessage`` (``delaymq.client.received``).

Held messages are keyed by (group, subject, epoch, sequence): settling one twice is a
no-op, and an answer showing that a server lost the tail of its pull log (it
hands out a sequence already seen) starts a new epoch, so acks of the old
numbering are never sent against the new one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import Any

from delaymq.client.acks import AckTracker, Settlement, SettleRequest
from delaymq.client.consumeroptions import (
    DEFAULT_FETCH_AHEAD,
    checked_broadcast,
    checked_group,
    checked_start,
    default_consumer_id,
    fetch_ahead_ms,
    retry_subject_of,
)
from delaymq.client.flow import FlowControl, PullLimit, TagFilter
from delaymq.client.links import (
    LIMITED_POLL_MS,
    PULL_BACKOFF,
    SETTLE_BACKOFF,
    SETTLE_CONCURRENCY,
    SETTLE_INTERVAL,
    ConsumerStatistics,
    GroupLink,
    pull_backoffs,
)
from delaymq.client.received import ReceivedMessage
from delaymq.client.retry import DEFAULT_MAX_ATTEMPTS, DEFAULT_RETRY_DELAYS, RetryPolicy
from delaymq.net.limits import DEFAULT_LIMITS, Limits
from delaymq.protocol.backoff import RandomSource
from delaymq.protocol.errors import RemoteProtocolError
from delaymq.protocol.fields import check_int, check_name
from delaymq.protocol.limits import (
    DEFAULT_POLL_MS,
    FRAME_RESERVE,
    MAX_NAME,
    MAX_POLL_MS,
    MAX_PULL,
    MAX_PULL_AHEAD_MS,
    MiB,
)
from delaymq.protocol.records import Message, decode_batch
from delaymq.protocol.subjects import original_subject


class ConsumerCore:
    """Every decision of a consumer of one subject in one consumer group. Not thread-safe.

    A clustered consumer pulls two subjects from every realtime group: the
    subject, and the group's retry subject (``%retry%<group>%<subject>``) where
    its nacked messages come back. ``retry=True`` picks the second in the
    methods that take it.
    """

    def __init__(
        self,
        subject: str,
        *,
        group: str,
        consumer_id: str | None = None,
        tags: Iterable[str] = (),
        broadcast: bool = False,
        start: str = "latest",
        max_messages_held: int = 1000,
        max_bytes_held: int = 64 * MiB,
        pull_batch: int = 100,
        poll_timeout_ms: int = DEFAULT_POLL_MS,
        fetch_ahead_ms: int = 0,
        retry_delays: Iterable[float | int | timedelta] = DEFAULT_RETRY_DELAYS,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        limits: Limits = DEFAULT_LIMITS,
        random: RandomSource | None = None,
        limit: int | None = None,
    ) -> None:
        self.subject = check_name(subject, "subject", limits.max_subject)
        self.group = checked_group(group)
        self.consumer_id = check_name(
            default_consumer_id() if consumer_id is None else consumer_id, "consumer_id", MAX_NAME
        )
        self.filter = TagFilter(tags, limits)
        self.broadcast = checked_broadcast(broadcast)
        self.start = checked_start(start)
        self.flow = FlowControl(max_messages_held, max_bytes_held)
        #: At most this many messages pulled in all (``limit``); then the consumer stops.
        self.limit = PullLimit(limit)
        self.pull_batch = check_int(pull_batch, "pull_batch", 1, MAX_PULL)
        self.poll_timeout_ms = check_int(poll_timeout_ms, "poll_timeout_ms", 0, MAX_POLL_MS)
        #: PULL takes records sent ahead up to this long before due (``ReleaseQueue`` holds them).
        self.fetch_ahead_ms = check_int(fetch_ahead_ms, "fetch_ahead_ms", 0, MAX_PULL_AHEAD_MS)
        self.retry_policy = RetryPolicy.from_options(retry_delays, max_attempts)
        #: Where nacked messages come back; None for a broadcast consumer (its nacks give back at once).
        self.retry_subject = retry_subject_of(group, subject, broadcast=broadcast, limits=limits)
        self.limits = limits
        self.random = random  # the jitter of pull backoffs; None: random.random
        self.links: dict[str, GroupLink] = {}
        # (group, retry lane, epoch, sequence) -> (body size, attempts)
        self._held: dict[tuple[str, bool, int, int], tuple[int, int]] = {}
        self._received = 0
        self._filtered = 0
        self._acked = 0
        self._nacked = 0
        self._pulls = 0
        self._pull_failures = 0
        self._gaps = 0
        self._settle_failures = 0
        self._retried = 0
        self._dead = 0
        self._received_retries = 0
        self._released = 0

    # -- routes ---------------------------------------------------------------

    @property
    def lanes(self) -> tuple[bool, ...]:
        """The subjects pulled from every group: ``(False,)`` the subject, ``True`` the retry subject too."""
        return (False,) if self.retry_subject is None else (False, True)

    def lane_subject(self, retry: bool) -> str:
        if retry:
            assert self.retry_subject is not None
            return self.retry_subject
        return self.subject

    def update_route(self, groups: Iterable[tuple[str, str]]) -> tuple[list[str], list[str]]:
        """Take the consumer route's (group, address) pairs; returns (groups to start, groups to stop)."""
        seen: set[str] = set()
        started: list[str] = []
        for name, address in groups:
            seen.add(name)
            link = self.links.get(name)
            if link is None:
                self.links[name] = GroupLink(name, address, backoffs=pull_backoffs(self.random))
                started.append(name)
                continue
            link.address = address  # a failover may move its master
            if not link.active:
                link.active = True
                started.append(name)
        stopped = [name for name, link in self.links.items() if link.active and name not in seen]
        for name in stopped:
            self.links[name].active = False
            self.limit.forget(name)
        return started, stopped

    # -- pulling --------------------------------------------------------------

    def pull_request(self, name: str, *, retry: bool = False) -> dict[str, Any] | None:
        """The next PULL's metadata for a group, or None while the flow caps (or the limit) allow none.

        What it asks for is reserved against the limit until ``accept_pull``,
        ``pull_failed`` or ``pull_abandoned`` of the same lane.
        """
        room = self.flow.room()
        if room is None:
            return None
        messages, size = room
        most = self.limit.reserve((name, retry), min(self.pull_batch, messages))
        if not most:
            return None
        self.links[name].trackers[retry].in_doubt = True  # until its answer is read
        poll_ms = self.poll_timeout_ms
        if self.limit.brief((name, retry), self.pull_batch):
            poll_ms = min(poll_ms, LIMITED_POLL_MS)  # its reservation may be what another lane waits for
        metadata: dict[str, Any] = {
            "group": self.group,
            "consumer": self.consumer_id,
            "subject": self.lane_subject(retry),
            "max": most,
            "max_bytes": max(1, min(size, self.limits.max_frame - FRAME_RESERVE)),
            "timeout_ms": poll_ms,
        }
        if self.fetch_ahead_ms:  # (absent, a server of before it serves the pull)
            metadata["ahead_ms"] = self.fetch_ahead_ms
        if self.filter.wire:
            metadata["tags"] = list(self.filter.wire)
        if self.broadcast:
            metadata["broadcast"] = True
        # The retry subject holds only this group's retries: a new share starts at its first.
        if self.start == "earliest" or retry:
            metadata["from"] = "earliest"
        return metadata

    def accept_pull(
        self,
        name: str,
        metadata: Mapping[str, Any],
        body: bytes,
        now_ms: int,
        settle: Callable[[ReceivedMessage, bool], Any] | None = None,
        *,
        retry: bool = False,
    ) -> list[ReceivedMessage]:
        """The messages of a PULL answer to hand to the application.

        Filtered messages are acked here, a gap is queued as a nack: after a
        call, ``has_pending`` says whether acks wait to be sent.
        ``RemoteProtocolError`` for an answer that does not add up.
        """
        start, server_acked, messages = self._decode_answer(name, metadata, body)
        tracker = self._answered(self.links[name], retry, start, len(messages), server_acked)
        epoch = tracker.epoch
        out: list[ReceivedMessage] = []
        held = self._held
        matches = self.filter.matches
        pulled_subject = self.lane_subject(retry) if retry else ""
        size_total = 0
        for offset, message in enumerate(messages):
            sequence = start + offset
            if not matches(message.tags):
                tracker.settle(sequence, ack=True)
                self._filtered += 1
                continue
            size = len(message.body)
            held[(name, retry, epoch, sequence)] = (size, message.attempts)
            size_total += size
            out.append(
                ReceivedMessage(
                    message.id,
                    original_subject(self.group, message.subject) if retry else message.subject,
                    message.tags,
                    message.properties,
                    message.body,
                    message.deliver_at,
                    message.created_at,
                    message.attempts,
                    now_ms,
                    name,
                    sequence,
                    pulled_subject=pulled_subject,
                    epoch=epoch,
                    settle=settle,
                )
            )
        self.flow.take(len(out), size_total)
        self._received += len(out)
        if retry:
            self._received_retries += len(out)
        return out

    def _decode_answer(self, name: str, metadata: Mapping[str, Any], body: bytes) -> tuple[int, int, list[Message]]:
        """A PULL answer's ``pull_start``, ``acked`` and records; ``RemoteProtocolError`` if they disagree."""
        start, count, server_acked = (_answer_int(metadata, key) for key in ("pull_start", "count", "acked"))
        messages = decode_batch(body, self.limits) if body else []
        if len(messages) != count:
            raise RemoteProtocolError(
                f"PULL answer from group {name} says count {count} but carries {len(messages)} records",
                code="bad_metadata",
                field="count",
            )
        return start, server_acked, messages

    def _answered(self, link: GroupLink, retry: bool, start: int, count: int, server_acked: int) -> AckTracker:
        """Count a pull that was answered; its subject's tracker, told what was handed out."""
        self._pulls += 1
        link.backoffs[retry].reset()
        self.limit.answered((link.name, retry), count)
        tracker = link.trackers[retry]
        tracker.in_doubt = False
        gap = tracker.handed(start, count, server_acked)
        if gap is not None:
            self._gaps += gap[1] - gap[0]
        return tracker

    def pull_failed(self, name: str, *, retry: bool = False, refused: bool = False) -> int:
        """A pull got no answer or (``refused``: nothing was handed out) a refusal worth
        retrying; returns the backoff in ms."""
        self._pull_failures += 1
        self.limit.abandoned((name, retry))
        link = self.links[name]
        if refused:
            link.trackers[retry].in_doubt = False
        return link.backoffs[retry].next_delay_ms()

    def pull_abandoned(self, name: str, *, retry: bool = False) -> None:
        """A pull given up before its answer (its group moved): its reservation is free again."""
        self.limit.abandoned((name, retry))

    # -- settling -------------------------------------------------------------

    def _lane_of(self, message: ReceivedMessage) -> bool:
        return bool(message.pulled_subject) and message.pulled_subject != self.subject

    def _take_held(self, message: ReceivedMessage) -> tuple[bool, int] | None:
        """Stop holding ``message``: (its lane, attempts), or None when it is not held (settled already)."""
        lane = self._lane_of(message)
        held = self._held.pop((message.server_group, lane, message.epoch, message.sequence), None)
        if held is None:
            return None
        size, attempts = held
        self.flow.release(1, size)
        return lane, attempts

    def _tracker_of(self, message: ReceivedMessage, lane: bool) -> AckTracker | None:
        """The tracker ``message`` is numbered in; None when its numbering is gone (a new epoch)."""
        link = self.links.get(message.server_group)
        if link is None or link.trackers[lane].epoch != message.epoch:
            return None
        return link.trackers[lane]

    def settle(self, message: ReceivedMessage, ack: bool) -> bool:
        """Ack (or nack) a held message; False when it was settled already.

        A nack asks for a retry after the policy's delay, or for the dead
        letters after the last attempt (a broadcast consumer's gives it back at once).
        """
        taken = self._take_held(message)
        if taken is None:
            return False  # settled already (or never held by this consumer)
        lane, attempts = taken
        retry = None
        if not ack and self.retry_subject is not None:
            retry = self.retry_policy.nack_for(attempts)
        tracker = self._tracker_of(message, lane)
        if tracker is not None:
            tracker.settle(message.sequence, ack=ack, retry=retry)
        if ack:
            self._acked += 1
        else:
            self._nacked += 1
            if retry is not None:
                if retry.dead:
                    self._dead += 1
                else:
                    self._retried += 1
        return True

    def release(self, messages: Iterable[ReceivedMessage]) -> int:
        """Give back held messages the application never saw: at once, ``attempts`` unchanged.

        Returns how many were held (the others were settled already).
        """
        count = 0
        for message in messages:
            taken = self._take_held(message)
            if taken is None:
                continue
            tracker = self._tracker_of(message, taken[0])
            if tracker is not None:
                tracker.settle(message.sequence, ack=False, release=True)
            count += 1
        self._released += count
        return count

    def release_all(self) -> int:
        """Nack every held message (the consumer is closing): the group gets them back at once."""
        count = 0
        for name, lane, epoch, sequence in list(self._held):
            size, _attempts = self._held.pop((name, lane, epoch, sequence))
            self.flow.release(1, size)
            link = self.links.get(name)
            if link is not None and link.trackers[lane].epoch == epoch:
                link.trackers[lane].settle(sequence, ack=False)
            self._nacked += 1
            count += 1
        return count

    def release_rest(self) -> int:
        """Closing: each lane whose PULL answer went unread releases all past what it read (one
        NACK with ``release`` and no ``end``); returns how many lanes do."""
        return sum(tracker.release_unread() for link in self.links.values() for tracker in link.trackers)

    def unsent(self) -> tuple[int, int, int]:
        """Still queued: (messages not given back, releases to the end, acks)."""
        trackers = [tracker for link in self.links.values() for tracker in link.trackers]
        back, rest, acks = zip(*(tracker.unsent() for tracker in trackers), strict=True) if trackers else ((), (), ())
        return sum(back), sum(rest), sum(acks)

    def has_pending(self) -> bool:
        return any(tracker.pending for link in self.links.values() for tracker in link.trackers)

    def take_pending(self) -> list[Settlement]:
        """Every group's unsent acks and nacks, per subject, taken out to send."""
        return [
            link.trackers[lane].take_settlement(link.name, link.address, self.lane_subject(lane), lane)
            for link in self.links.values()
            for lane in self.lanes
            if link.trackers[lane].pending
        ]

    def settle_failed(self, settlement: Settlement, unsent: Iterable[SettleRequest]) -> None:
        """Put back the requests a failed ACK/NACK round did not deliver, to try again."""
        self._settle_failures += 1
        link = self.links.get(settlement.group)
        if link is None:
            return
        tracker = link.trackers[settlement.retry_lane]
        if tracker.epoch == settlement.epoch:
            tracker.put_back(unsent)

    def settle_metadata(self, settlement: Settlement, request: SettleRequest) -> dict[str, Any]:
        """The ACK or NACK request's metadata."""
        metadata: dict[str, Any] = {
            "group": self.group,
            "consumer": self.consumer_id,
            "subject": settlement.subject or self.subject,
            "start": request.start,
        }
        if request.end is not None:  # (a release without one runs to the end of the server's pull log)
            metadata["end"] = request.end
        if request.release:
            metadata["release"] = True
        if request.retry is not None:
            metadata["delay_ms"] = request.retry.delay_ms
            metadata["dead"] = request.retry.dead
        return metadata

    def heartbeat_metadata(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "consumer": self.consumer_id,
            "subjects": [self.lane_subject(lane) for lane in self.lanes],
        }

    def heartbeat_targets(self) -> list[tuple[str, str]]:
        """(group, address) of every group this consumer holds or pulls messages from."""
        return [
            (link.name, link.address)
            for link in self.links.values()
            if link.active or any(tracker.outstanding() for tracker in link.trackers)
        ]

    def statistics(self) -> ConsumerStatistics:
        return ConsumerStatistics(
            subject=self.subject,
            group=self.group,
            consumer_id=self.consumer_id,
            server_groups=tuple(name for name, link in self.links.items() if link.active),
            held_messages=self.flow.messages,
            held_bytes=self.flow.bytes,
            received=self._received,
            filtered=self._filtered,
            acked=self._acked,
            nacked=self._nacked,
            pulls=self._pulls,
            pull_failures=self._pull_failures,
            gaps_nacked=self._gaps,
            settle_failures=self._settle_failures,
            retried=self._retried,
            dead=self._dead,
            received_retries=self._received_retries,
            released=self._released,
        )


def _answer_int(metadata: Mapping[str, Any], key: str) -> int:
    value = metadata.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise RemoteProtocolError(f"PULL answer has no integer {key!r} (got {value!r})", code="bad_metadata", field=key)
    return value


# The core's parts are importable from here too: the consumer's names in one place.
__all__ = [
    "DEFAULT_FETCH_AHEAD",
    "AckTracker",
    "ConsumerCore",
    "ConsumerStatistics",
    "FlowControl",
    "GroupLink",
    "PULL_BACKOFF",
    "ReceivedMessage",
    "SETTLE_BACKOFF",
    "SETTLE_CONCURRENCY",
    "SETTLE_INTERVAL",
    "SettleRequest",
    "Settlement",
    "TagFilter",
    "default_consumer_id",
    "fetch_ahead_ms",
]
