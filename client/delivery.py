"""The consumer's sans-IO core: what to pull, what arrived, what to ack.

``ConsumerCore`` holds every decision of a consumer, fed PULL answers and
times; ``Consumer`` (trio) only moves bytes around it (``BlockingConsumer``
runs that same ``Consumer`` on a loop thread). Its parts:

- per realtime group (``GroupLink``) and subject pulled (the subject, and the
  group's retry subject ``%retry%<group>%<subject>`` where nacked messages come
  back) an ``AckTracker`` (``delaymq.client.acks``): the pull log as handed out
  and the acks and nacks not sent yet;
- a ``TagFilter`` and ``FlowControl`` (``delaymq.client.flow``): the exact tag
  check the server's bitmask only narrows, and the caps on what is held;
- the messages it hands out, ``ReceivedMessage`` (``delaymq.client.received``).

Held messages are keyed by (group, subject, epoch, sequence): settling one twice is a
no-op, and an answer showing that a server lost the tail of its pull log (it
hands out a sequence already seen) starts a new epoch, so acks of the old
numbering are never sent against the new one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
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
from delaymq.client.flow import FlowControl, TagFilter
from delaymq.client.received import ReceivedMessage
from delaymq.client.retry import DEFAULT_MAX_ATTEMPTS, DEFAULT_RETRY_DELAYS, RetryPolicy
from delaymq.net.limits import DEFAULT_LIMITS, Limits
from delaymq.protocol.backoff import Backoff, BackoffRun, RandomSource
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

#: The wait after a failed pull, before that subject is pulled from that group again.
#: "Equal" jitter: at least half the ceiling, so a consumer never pulls a group that is
#: down in a tight loop, while the consumers that lost it together come back spread out.
#: The cap bounds how long after a restarted group is back its consumers pull it again.
PULL_BACKOFF = Backoff(initial_ms=100, maximum_ms=500, jitter="equal")
#: The wait after an ACK/NACK round that could not deliver everything, before the next round
#: (the ranges stay queued meanwhile). A group's move to a new master ends the wait at once.
SETTLE_BACKOFF = Backoff(initial_ms=100, maximum_ms=5_000, jitter="equal")
#: ACK/NACK rounds start at least this far apart (seconds; ``Consumer.flush`` and closing
#: do not wait): each ACK waits for a checkpoint of the realtime server (fsyncs and an lmdb
#: transaction), so the acks of a round's worth of messages travel as one range instead
#: of one request and one checkpoint every few milliseconds. Acks are at-least-once
#: either way: a consumer that dies has its unsent acks' messages handed out again. A quarter
#: of a second cost the realtime server about a fifth less CPU than 0.1 s (docs/performance.md).
SETTLE_INTERVAL = 0.25
#: At most this many ACK/NACK requests of one round on the way at once (each is one range).
SETTLE_CONCURRENCY = 16


def _pull_backoffs(random: RandomSource | None = None) -> tuple[BackoffRun, BackoffRun]:
    return BackoffRun(PULL_BACKOFF, random=random), BackoffRun(PULL_BACKOFF, random=random)


@dataclass(slots=True)
class GroupLink:
    """One realtime group this consumer pulls from: the subject, and the group's retry subject."""

    name: str
    address: str
    # One pull log per subject pulled: [0] the subject, [1] the group's retry subject.
    trackers: tuple[AckTracker, AckTracker] = field(default_factory=lambda: (AckTracker(), AckTracker()))
    active: bool = True  # still in the consumer route
    # The backoff after failed pulls, per subject pulled (as ``trackers``).
    backoffs: tuple[BackoffRun, BackoffRun] = field(default_factory=_pull_backoffs)

    @property
    def tracker(self) -> AckTracker:
        """The subject's pull log (``trackers[1]`` is the retry subject's)."""
        return self.trackers[0]


@dataclass(frozen=True, slots=True)
class ConsumerStatistics:
    subject: str
    group: str
    consumer_id: str
    server_groups: tuple[str, ...]
    held_messages: int
    held_bytes: int
    received: int  # messages taken from the servers for the application (fetched ahead: on arrival)
    filtered: int  # messages the server's tag mask let through and the exact check dropped
    acked: int
    nacked: int
    pulls: int
    pull_failures: int
    gaps_nacked: int  # sequences handed out but never seen (lost answers), given back
    settle_failures: int  # ACK/NACK requests that failed (retried)
    retried: int = 0  # nacks that asked for a retry after a delay
    dead: int = 0  # nacks of a last attempt: sent to the dead-letter subject
    received_retries: int = 0  # messages that came back from the retry subject


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
                self.links[name] = GroupLink(name, address, backoffs=_pull_backoffs(self.random))
                started.append(name)
                continue
            link.address = address  # a failover may move its master
            if not link.active:
                link.active = True
                started.append(name)
        stopped = [name for name, link in self.links.items() if link.active and name not in seen]
        for name in stopped:
            self.links[name].active = False
        return started, stopped

    # -- pulling --------------------------------------------------------------

    def pull_request(self, name: str, *, retry: bool = False) -> dict[str, Any] | None:
        """The next PULL's metadata for a group, or None while the flow caps are reached."""
        room = self.flow.room()
        if room is None:
            return None
        messages, size = room
        metadata: dict[str, Any] = {
            "group": self.group,
            "consumer": self.consumer_id,
            "subject": self.lane_subject(retry),
            "max": min(self.pull_batch, messages),
            "max_bytes": max(1, min(size, self.limits.max_frame - FRAME_RESERVE)),
            "timeout_ms": self.poll_timeout_ms,
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
        tracker = link.trackers[retry]
        gap = tracker.handed(start, count, server_acked)
        if gap is not None:
            self._gaps += gap[1] - gap[0]
        return tracker

    def pull_failed(self, name: str, *, retry: bool = False) -> int:
        """A pull got no answer or a refusal worth retrying; returns the backoff in ms."""
        self._pull_failures += 1
        return self.links[name].backoffs[retry].next_delay_ms()

    # -- settling -------------------------------------------------------------

    def _lane_of(self, message: ReceivedMessage) -> bool:
        return bool(message.pulled_subject) and message.pulled_subject != self.subject

    def settle(self, message: ReceivedMessage, ack: bool) -> bool:
        """Ack (or nack) a held message; False when it was settled already.

        A nack asks for a retry after the policy's delay, or for the dead
        letters after the last attempt (a broadcast consumer's gives it back at once).
        """
        lane = self._lane_of(message)
        held = self._held.pop((message.server_group, lane, message.epoch, message.sequence), None)
        if held is None:
            return False  # settled already (or never held by this consumer)
        size, attempts = held
        self.flow.release(1, size)
        retry = None
        if not ack and self.retry_subject is not None:
            retry = self.retry_policy.nack_for(attempts)
        link = self.links.get(message.server_group)
        if link is not None and link.trackers[lane].epoch == message.epoch:
            link.trackers[lane].settle(message.sequence, ack=ack, retry=retry)
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

    def has_pending(self) -> bool:
        return any(tracker.pending for link in self.links.values() for tracker in link.trackers)

    def take_pending(self) -> list[Settlement]:
        """Every group's unsent acks and nacks, per subject, taken out to send."""
        out = []
        for link in self.links.values():
            for lane in self.lanes:
                tracker = link.trackers[lane]
                if tracker.pending:
                    acks, nacks, retries = tracker.to_ack.take(), tracker.to_nack.take(), tracker.take_retries()
                    out.append(
                        Settlement(
                            link.name, link.address, tracker.epoch, acks, nacks, retries, self.lane_subject(lane), lane
                        )
                    )
        return out

    def settle_failed(self, settlement: Settlement, unsent: Iterable[SettleRequest]) -> None:
        """Put back the requests a failed ACK/NACK round did not deliver, to try again."""
        self._settle_failures += 1
        link = self.links.get(settlement.group)
        if link is None:
            return
        tracker = link.trackers[settlement.retry_lane]
        if tracker.epoch != settlement.epoch:
            return
        for request in unsent:
            if request.ack:
                tracker.to_ack.add(request.start, request.end)
            elif request.retry is None:
                tracker.to_nack.add(request.start, request.end)
            else:
                tracker.retry_ranges(request.retry).add(request.start, request.end)

    def settle_metadata(self, settlement: Settlement, request: SettleRequest) -> dict[str, Any]:
        """The ACK or NACK request's metadata."""
        metadata: dict[str, Any] = {
            "group": self.group,
            "consumer": self.consumer_id,
            "subject": settlement.subject or self.subject,
            "start": request.start,
            "end": request.end,
        }
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
