"""The consumer's sans-IO core: what to pull, what arrived, what to ack.

``ConsumerCore`` holds every decision of a consumer, fed PULL answers and
times; ``Consumer`` (trio) and ``BlockingConsumer`` (threads) only move bytes
around it, so both behave alike:

- per realtime group an ``AckTracker``: the consumer's pull-log sequences as
  handed out, the contiguous settled prefix, and the acked / nacked ranges
  not sent yet (merged, so many acks travel as a few ``[start, end)`` ranges);
- a ``TagFilter``: the server filters by a 64-bit mask, which lets through
  tags that share a bit, so the exact check runs here; a message whose tags do
  not match is acked silently and never shown;
- ``FlowControl``: messages and bytes held (pulled, not yet acked or nacked);
  pulls stop while either cap is reached.

Held messages are keyed by (group, epoch, sequence): settling one twice is a
no-op, and an answer showing that a server lost the tail of its pull log (it
hands out a sequence already seen) starts a new epoch, so acks of the old
numbering are never sent against the new one.
"""

from __future__ import annotations

import bisect
import os
import re
import socket
from collections.abc import Callable, Iterable, Mapping
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from delaymq.protocol.errors import LocalProtocolError, RemoteProtocolError
from delaymq.protocol.limits import DEFAULT_LIMITS, MiB, Limits
from delaymq.protocol.records import decode_batch

#: Longest group or consumer name (UTF-8 bytes), as the realtime server checks it.
MAX_NAME = 255
#: Most messages one PULL may ask for, and the longest long poll, as the server allows.
MAX_PULL = 10_000
MAX_POLL_MS = 300_000
#: Room kept in a PULL answer's frame for its header and metadata.
FRAME_RESERVE = 64 * 1024
STARTS = ("latest", "earliest")
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def check_name(value: Any, field: str, limit: int) -> str:
    """A subject, group, consumer id or tag: 1..limit UTF-8 bytes, no control characters."""
    if type(value) is not str:
        raise LocalProtocolError(f"{field} is of type {type(value).__name__}, not str", code="bad_value", field=field)
    try:
        size = len(value.encode())
    except UnicodeEncodeError:
        raise LocalProtocolError(
            f"{field} {value!r} is not valid Unicode text", code="bad_value", field=field
        ) from None
    if not 0 < size <= limit:
        raise LocalProtocolError(
            f"{field} is {size} UTF-8 bytes, must be 1 to {limit}", code="limit", field=field, limit=limit
        )
    if not value.isprintable() and _CONTROL.search(value):
        raise LocalProtocolError(f"{field} {value!r} holds a control character", code="bad_value", field=field)
    return value


def _check_int(value: Any, field: str, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise LocalProtocolError(f"{field} is of type {type(value).__name__}, not int", code="bad_value", field=field)
    if not low <= value <= high:
        raise LocalProtocolError(
            f"{field} is {value}, must be {low} to {high}",
            code="limit",
            field=field,
            limit=high if value > high else low,
        )
    return value


def default_consumer_id() -> str:
    """host-pid-random: unique per consumer, readable in server statistics."""
    return f"{socket.gethostname()[:200]}-{os.getpid()}-{os.urandom(4).hex()}"


# --------------------------------------------------------------------- ranges


class RangeSet:
    """Sorted, disjoint, non-touching ``[start, end)`` ranges; adding merges neighbours."""

    __slots__ = ("_starts", "_ends")

    def __init__(self, ranges: Iterable[tuple[int, int]] = ()) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        for start, end in ranges:
            self.add(start, end)

    def add(self, start: int, end: int) -> None:
        if start >= end:
            return
        starts, ends = self._starts, self._ends
        low = bisect.bisect_left(ends, start)  # first range ending at or after start
        high = bisect.bisect_right(starts, end)  # past the last range starting at or before end
        if low < high:
            start = min(start, starts[low])
            end = max(end, ends[high - 1])
        starts[low:high] = [start]
        ends[low:high] = [end]

    def __contains__(self, value: object) -> bool:
        if not isinstance(value, int):
            return False
        index = bisect.bisect_right(self._starts, value) - 1
        return index >= 0 and value < self._ends[index]

    def first(self) -> tuple[int, int] | None:
        return (self._starts[0], self._ends[0]) if self._starts else None

    def pop_first(self) -> tuple[int, int]:
        return self._starts.pop(0), self._ends.pop(0)

    def ranges(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._ends))

    def take(self) -> list[tuple[int, int]]:
        """Every range, and empty the set."""
        ranges = self.ranges()
        self._starts, self._ends = [], []
        return ranges

    def total(self) -> int:
        return sum(end - start for start, end in zip(self._starts, self._ends))

    def __bool__(self) -> bool:
        return bool(self._starts)

    def __len__(self) -> int:
        return len(self._starts)

    def __repr__(self) -> str:
        return f"RangeSet({self.ranges()})"


class AckTracker:
    """A consumer's pull log on one realtime group, as the client sees it.

    ``acked`` is the contiguous settled prefix (everything below it is acked,
    nacked or filtered); ``end`` the next sequence the server will hand out.
    ``to_ack`` / ``to_nack`` are the settled ranges not yet sent.
    """

    __slots__ = ("acked", "end", "epoch", "started", "_settled", "to_ack", "to_nack")

    def __init__(self) -> None:
        self.acked = 0
        self.end = 0
        self.epoch = 0
        self.started = False
        self._settled = RangeSet()  # settled sequences at or above ``acked``
        self.to_ack = RangeSet()
        self.to_nack = RangeSet()

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
                self._settled.take()
            self.started = True
            self.acked = self.end = min(server_acked, start)
        gap = None
        if start > self.end:
            gap = (self.end, start)
            self._settled.add(*gap)
            self.to_nack.add(*gap)
            self._advance()
        self.end = max(self.end, start + count)
        return gap

    def settle(self, sequence: int, *, ack: bool) -> bool:
        """Mark one sequence acked (or nacked); False if it was settled already or never handed."""
        if not self.acked <= sequence < self.end or sequence in self._settled:
            return False
        self._settled.add(sequence, sequence + 1)
        (self.to_ack if ack else self.to_nack).add(sequence, sequence + 1)
        self._advance()
        return True

    def _advance(self) -> None:
        first = self._settled.first()
        if first is not None and first[0] <= self.acked:
            self.acked = max(self.acked, self._settled.pop_first()[1])

    @property
    def pending(self) -> bool:
        return bool(self.to_ack) or bool(self.to_nack)

    def outstanding(self) -> int:
        """Sequences handed out and not settled."""
        return self.end - self.acked - self._settled.total()


# ----------------------------------------------------------------- tags, flow


class TagFilter:
    """The exact any-of tag check (the server's bitmask only narrows)."""

    __slots__ = ("tags", "wire")

    def __init__(self, tags: Iterable[str], limits: Limits = DEFAULT_LIMITS) -> None:
        if isinstance(tags, str):
            raise LocalProtocolError("tags is a str, not a sequence of str", code="bad_value", field="tags")
        wanted = list(dict.fromkeys(check_name(tag, "tag", limits.max_tag) for tag in tags))
        if len(wanted) > limits.max_tags:
            raise LocalProtocolError(
                f"{len(wanted)} tags, limit {limits.max_tags}", code="limit", field="tags", limit=limits.max_tags
            )
        self.wire = wanted  # what PULL asks the server for
        self.tags = frozenset(wanted)

    def matches(self, tags: Iterable[str]) -> bool:
        if not self.tags:
            return True
        wanted = self.tags
        return any(tag in wanted for tag in tags)


class FlowControl:
    """Messages and bytes held: pulled and not yet settled. Pulls stop at either cap.

    Bytes are message bodies. A pull asks for at most the room left, but a
    server hands out at least one message however large, so ``held_bytes``
    may pass its cap by one message.
    """

    __slots__ = ("max_messages", "max_bytes", "messages", "bytes")

    def __init__(self, max_messages: int, max_bytes: int) -> None:
        self.max_messages = _check_int(max_messages, "max_messages_held", 1, 1 << 40)
        self.max_bytes = _check_int(max_bytes, "max_bytes_held", 1, 1 << 50)
        self.messages = 0
        self.bytes = 0

    def room(self) -> tuple[int, int] | None:
        """(messages, bytes) a pull may still bring in; None when a cap is reached."""
        messages = self.max_messages - self.messages
        size = self.max_bytes - self.bytes
        if messages <= 0 or size <= 0:
            return None
        return messages, size

    def take(self, count: int, size: int) -> None:
        self.messages += count
        self.bytes += size

    def release(self, count: int, size: int) -> None:
        self.messages -= count
        self.bytes -= size


# ------------------------------------------------------------------ messages


@dataclass(frozen=True, slots=True, eq=False)
class ReceivedMessage:
    """A message handed to this consumer; settle it with ``ack()`` or ``nack()``.

    From a trio ``Consumer`` ``ack()``/``nack()`` are awaited; from a
    ``BlockingConsumer`` they are plain calls. ``received_at``, ``deliver_at``
    and ``created_at`` are epoch milliseconds (UTC). ``server_group`` and
    ``sequence`` say where it sits in this consumer's pull log.
    """

    id: str
    subject: str
    tags: tuple[str, ...]
    properties: dict[str, Any]
    body: bytes
    deliver_at: int
    created_at: int
    attempts: int
    received_at: int
    server_group: str
    sequence: int
    _: KW_ONLY
    epoch: int = field(default=0, repr=False)
    settle: Callable[[ReceivedMessage, bool], Any] | None = field(default=None, repr=False)

    def ack(self) -> Any:
        """Done with it: the group will not hand it out again."""
        return self._settle(True)

    def nack(self) -> Any:
        """Not done: give it back to the group now (its ``attempts`` goes up)."""
        return self._settle(False)

    def _settle(self, ack: bool) -> Any:
        if self.settle is None:
            raise RuntimeError("this message was not received from a consumer")
        return self.settle(self, ack)

    @property
    def lateness_ms(self) -> int:
        """How long after its ``deliver_at`` it reached this process."""
        return self.received_at - self.deliver_at

    def text(self) -> str:
        """The body as UTF-8 text (``UnicodeDecodeError`` if it is not)."""
        return self.body.decode()


# ------------------------------------------------------------------- the core


@dataclass(slots=True)
class GroupLink:
    """One realtime group this consumer pulls from."""

    name: str
    address: str
    tracker: AckTracker = field(default_factory=AckTracker)
    active: bool = True  # still in the consumer route
    failures: int = 0  # consecutive failed pulls, for the backoff

    def backoff_ms(self) -> int:
        return min(5_000, 100 * (1 << min(self.failures, 6)))


@dataclass(frozen=True, slots=True)
class Settlement:
    """Acks and nacks to send to one group (taken from its tracker)."""

    group: str
    address: str
    epoch: int
    acks: list[tuple[int, int]]
    nacks: list[tuple[int, int]]


@dataclass(frozen=True, slots=True)
class ConsumerStatistics:
    subject: str
    group: str
    consumer_id: str
    server_groups: tuple[str, ...]
    held_messages: int
    held_bytes: int
    received: int  # messages handed to the application
    filtered: int  # messages the server's tag mask let through and the exact check dropped
    acked: int
    nacked: int
    pulls: int
    pull_failures: int
    gaps_nacked: int  # sequences handed out but never seen (lost answers), given back
    settle_failures: int  # ACK/NACK requests that failed (retried)


class ConsumerCore:
    """Every decision of a consumer of one subject in one consumer group. Not thread-safe."""

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
        poll_timeout_ms: int = 30_000,
        limits: Limits = DEFAULT_LIMITS,
    ) -> None:
        self.subject = check_name(subject, "subject", limits.max_subject)
        self.group = check_name(group, "group", MAX_NAME)
        self.consumer_id = check_name(
            default_consumer_id() if consumer_id is None else consumer_id, "consumer_id", MAX_NAME
        )
        self.filter = TagFilter(tags, limits)
        if type(broadcast) is not bool:
            raise LocalProtocolError(f"broadcast is {broadcast!r}, not a bool", code="bad_value", field="broadcast")
        self.broadcast = broadcast
        if start not in STARTS:
            raise LocalProtocolError(
                f"start is {start!r}, must be 'latest' or 'earliest'", code="bad_value", field="start"
            )
        self.start = start
        self.flow = FlowControl(max_messages_held, max_bytes_held)
        self.pull_batch = _check_int(pull_batch, "pull_batch", 1, MAX_PULL)
        self.poll_timeout_ms = _check_int(poll_timeout_ms, "poll_timeout_ms", 0, MAX_POLL_MS)
        self.limits = limits
        self.links: dict[str, GroupLink] = {}
        self._held: dict[tuple[str, int, int], int] = {}  # (group, epoch, sequence) -> body size
        self._received = 0
        self._filtered = 0
        self._acked = 0
        self._nacked = 0
        self._pulls = 0
        self._pull_failures = 0
        self._gaps = 0
        self._settle_failures = 0

    # -- routes ---------------------------------------------------------------

    def update_route(self, groups: Iterable[tuple[str, str]]) -> tuple[list[str], list[str]]:
        """Take the consumer route's (group, address) pairs; returns (groups to start, groups to stop)."""
        seen: set[str] = set()
        started: list[str] = []
        for name, address in groups:
            seen.add(name)
            link = self.links.get(name)
            if link is None:
                self.links[name] = GroupLink(name, address)
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

    def pull_request(self, name: str) -> dict[str, Any] | None:
        """The next PULL's metadata for a group, or None while the flow caps are reached."""
        room = self.flow.room()
        if room is None:
            return None
        messages, size = room
        metadata: dict[str, Any] = {
            "group": self.group,
            "consumer": self.consumer_id,
            "subject": self.subject,
            "max": min(self.pull_batch, messages),
            "max_bytes": max(1, min(size, self.limits.max_frame - FRAME_RESERVE)),
            "timeout_ms": self.poll_timeout_ms,
        }
        if self.filter.wire:
            metadata["tags"] = list(self.filter.wire)
        if self.broadcast:
            metadata["broadcast"] = True
        if self.start == "earliest":
            metadata["from"] = "earliest"
        return metadata

    def accept_pull(
        self,
        name: str,
        metadata: Mapping[str, Any],
        body: bytes,
        now_ms: int,
        settle: Callable[[ReceivedMessage, bool], Any] | None = None,
    ) -> list[ReceivedMessage]:
        """The messages of a PULL answer to hand to the application.

        Filtered messages are acked here, a gap is queued as a nack: after a
        call, ``has_pending`` says whether acks wait to be sent.
        ``RemoteProtocolError`` for an answer that does not add up.
        """
        link = self.links[name]
        start, count, server_acked = (_answer_int(metadata, key) for key in ("pull_start", "count", "acked"))
        messages = decode_batch(body, self.limits) if body else []
        if len(messages) != count:
            raise RemoteProtocolError(
                f"PULL answer from group {name} says count {count} but carries {len(messages)} records",
                code="bad_metadata",
                field="count",
            )
        self._pulls += 1
        link.failures = 0
        tracker = link.tracker
        gap = tracker.handed(start, count, server_acked)
        if gap is not None:
            self._gaps += gap[1] - gap[0]
        epoch = tracker.epoch
        out: list[ReceivedMessage] = []
        held = self._held
        matches = self.filter.matches
        size_total = 0
        for offset, message in enumerate(messages):
            sequence = start + offset
            if not matches(message.tags):
                tracker.settle(sequence, ack=True)
                self._filtered += 1
                continue
            size = len(message.body)
            held[(name, epoch, sequence)] = size
            size_total += size
            out.append(
                ReceivedMessage(
                    message.id,
                    message.subject,
                    message.tags,
                    message.properties,
                    message.body,
                    message.deliver_at,
                    message.created_at,
                    message.attempts,
                    now_ms,
                    name,
                    sequence,
                    epoch=epoch,
                    settle=settle,
                )
            )
        self.flow.take(len(out), size_total)
        self._received += len(out)
        return out

    def pull_failed(self, name: str) -> int:
        """A pull got no answer or a refusal worth retrying; returns the backoff in ms."""
        link = self.links[name]
        link.failures += 1
        self._pull_failures += 1
        return link.backoff_ms()

    # -- settling -------------------------------------------------------------

    def settle(self, message: ReceivedMessage, ack: bool) -> bool:
        """Ack (or nack) a held message; False when it was settled already."""
        size = self._held.pop((message.server_group, message.epoch, message.sequence), None)
        if size is None:
            return False  # settled already (or never held by this consumer)
        self.flow.release(1, size)
        link = self.links.get(message.server_group)
        if link is not None and link.tracker.epoch == message.epoch:
            link.tracker.settle(message.sequence, ack=ack)
        if ack:
            self._acked += 1
        else:
            self._nacked += 1
        return True

    def release_all(self) -> int:
        """Nack every held message (the consumer is closing); returns how many."""
        count = 0
        for name, epoch, sequence in list(self._held):
            size = self._held.pop((name, epoch, sequence))
            self.flow.release(1, size)
            link = self.links.get(name)
            if link is not None and link.tracker.epoch == epoch:
                link.tracker.settle(sequence, ack=False)
            self._nacked += 1
            count += 1
        return count

    def has_pending(self) -> bool:
        return any(link.tracker.pending for link in self.links.values())

    def take_pending(self) -> list[Settlement]:
        """Every group's unsent acks and nacks, taken out to send."""
        out = []
        for link in self.links.values():
            tracker = link.tracker
            if tracker.pending:
                acks, nacks = tracker.to_ack.take(), tracker.to_nack.take()
                out.append(Settlement(link.name, link.address, tracker.epoch, acks, nacks))
        return out

    def settle_failed(self, settlement: Settlement, acks: list[tuple[int, int]], nacks: list[tuple[int, int]]) -> None:
        """Put back the ranges a failed ACK/NACK round did not deliver, to try again."""
        self._settle_failures += 1
        link = self.links.get(settlement.group)
        if link is None or link.tracker.epoch != settlement.epoch:
            return
        for start, end in acks:
            link.tracker.to_ack.add(start, end)
        for start, end in nacks:
            link.tracker.to_nack.add(start, end)

    def settle_metadata(self, start: int, end: int) -> dict[str, Any]:
        return {"group": self.group, "consumer": self.consumer_id, "subject": self.subject, "start": start, "end": end}

    def heartbeat_metadata(self) -> dict[str, Any]:
        return {"group": self.group, "consumer": self.consumer_id, "subjects": [self.subject]}

    def heartbeat_targets(self) -> list[tuple[str, str]]:
        """(group, address) of every group this consumer holds or pulls messages from."""
        return [(link.name, link.address) for link in self.links.values() if link.active or link.tracker.outstanding()]

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
        )


def _answer_int(metadata: Mapping[str, Any], key: str) -> int:
    value = metadata.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise RemoteProtocolError(f"PULL answer has no integer {key!r} (got {value!r})", code="bad_metadata", field=key)
    return value


__all__ = [
    "AckTracker",
    "ConsumerCore",
    "ConsumerStatistics",
    "FlowControl",
    "GroupLink",
    "RangeSet",
    "ReceivedMessage",
    "Settlement",
    "TagFilter",
    "check_name",
    "default_consumer_id",
]
