"""The producer, for trio code: ``open_producer(meta) as producer``, then ``send``.

A message due now goes to a realtime group (route ``immediate-producer``,
command SEND); one due later (``delay=`` or ``at=``) to a scheduler group
(route ``delayed-producer``, command SCHEDULE) with its ``deliver_at``. Every
message is checked here before anything is sent, and gets its id here, so a
batch refused by one group and retried on another is stored once (servers
drop ids they already hold). Routes, group choice, avoidance of slow groups
and retries are the route client's (``delaymq.client.routes``).

A request that gets no answer, or a "try elsewhere" refusal, is retried, other
groups first, then with a growing backoff with jitter, for up to
``send_timeout`` seconds (default 30, like Kafka's ``delivery.timeout.ms``),
so a server restart or failover is a pause, not an error. A retry whose
records the server already stored (the answer to the first try was lost) is
answered "duplicate": that is success. Past ``send_timeout`` ``CallTimedOut``
(a ``CallFailed``) lists what was tried; a refusal of the request itself
(a limit, a bad value) is raised at once.

A scheduled message can be cancelled, moved or looked up until it is delivered, by
id or by the business key it was sent with (``key=``): ``cancel``, ``move`` and
``query`` ask the scheduler group ``group=`` names (``send`` returns a ``SentId``
whose ``group`` says which stored it), or else every scheduler group
(``delaymq.client.scheduled``).

Example::

    async with open_producer("127.0.0.1:20880") as producer:
        order_id = await producer.send("orders", b'{"id": 7}', tags=["paid"])
        reminder = await producer.send("reminders", "call back", delay=timedelta(hours=2), key="booking-9")
        ids = await producer.send_batch(
            [producer.message("orders", f"order {n}", at=datetime(2026, 12, 24, tzinfo=timezone.utc))
             for n in range(100)]
        )
        await producer.move(reminder, delay=timedelta(hours=3), group=reminder.group)
        [state] = await producer.cancel(subject="reminders", key="booking-9")  # state.state: "cancelled"
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from delaymq.client.messages import (
    DEFAULT_BATCH_BYTES,
    DEFAULT_BATCH_MESSAGES,
    At,
    BatchPlan,
    Delay,
    OutgoingFrame,
    SentId,
    build_message,
    check_horizon,
    check_results,
    delivery_time,
    plan_frames,
    with_batch_index,
)
from delaymq.client.routes import (
    CLIENT_PEERS_OPTIONS,
    RouteClient,
    RouteClientStatistics,
    check_retry_for,
    meta_addresses,
)
from delaymq.client.scheduled import GroupCalls, MessageState, select, with_locations
from delaymq.clock import Clock, SystemClock
from delaymq.net.limits import DEFAULT_LIMITS, Limits
from delaymq.net.peers import AsyncCaller, open_peers
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import LocalProtocolError, PeerError
from delaymq.protocol.records import Message
from delaymq.protocol.routes import RouteKind

#: Where a client finds the metaserver unless told otherwise.
DEFAULT_META = "127.0.0.1:20880"
#: Seconds a request keeps being retried before the send fails.
DEFAULT_SEND_TIMEOUT = 30.0


@dataclass(frozen=True, slots=True)
class ProducerStatistics:
    messages: int  # messages the servers answered for
    immediate: int  # of them, sent to realtime groups
    delayed: int  # of them, scheduled
    duplicates: int  # answered "duplicate": the server already held that id
    frames: int  # requests answered
    routes: RouteClientStatistics


def check_options(*, attempts: int, batch_bytes: int, batch_messages: int, send_timeout: float) -> None:
    """``ValueError`` naming the first producer option that cannot work."""
    if attempts < 1:
        raise ValueError(f"attempts is {attempts}, must be at least 1")
    if batch_bytes < 1 or batch_messages < 1:
        raise ValueError(f"batch_bytes ({batch_bytes}) and batch_messages ({batch_messages}) must be at least 1")
    check_retry_for(send_timeout, "send_timeout")


class ProducerCore:
    """The producer's sans-IO part: building and checking messages, planning frames, counting answers.

    ``Producer`` adds the I/O (route calls); kept apart so the decisions are tested without a network.
    """

    def __init__(
        self,
        *,
        clock: Clock,
        limits: Limits,
        batch_bytes: int,
        batch_messages: int,
        attempts: int,
        timeout: float | None,
        send_timeout: float = DEFAULT_SEND_TIMEOUT,
    ) -> None:
        check_options(attempts=attempts, batch_bytes=batch_bytes, batch_messages=batch_messages,
                      send_timeout=send_timeout)  # fmt: skip
        self.clock = clock
        self.limits = limits
        self.batch_bytes = batch_bytes
        self.batch_messages = batch_messages
        self.attempts = attempts  # groups one round of retries tries before it backs off
        self.timeout = timeout  # seconds, per try
        self.send_timeout = float(send_timeout)  # seconds a request keeps being retried
        self._messages = 0
        self._delayed = 0
        self._duplicates = 0
        self._frames = 0

    def message(
        self,
        subject: str,
        body: bytes | str = b"",
        *,
        tags: Iterable[str] = (),
        properties: Mapping[str, Any] | None = None,
        id: str | None = None,
        delay: Delay | None = None,
        at: At | None = None,
        key: str | None = None,
    ) -> Message:
        """A checked message for ``send_batch``, with its id and ``deliver_at`` fixed now.

        ``delay`` is seconds or a ``timedelta``; ``at`` an aware ``datetime`` or
        epoch ms; ``key`` a business key (see ``send``). Keep the message to retry
        a failed ``send_batch``: the same ids are stored once.
        """
        return build_message(
            subject,
            body,
            tags=tags,
            properties=properties,
            id=id,
            delay=delay,
            at=at,
            key=key,
            now_ms=self.clock.now_ms(),
            limits=self.limits,
        )

    def plan_one(
        self,
        subject: str,
        body: bytes | str,
        *,
        tags: Iterable[str],
        properties: Mapping[str, Any] | None,
        id: str | None,
        delay: Delay | None,
        at: At | None,
        key: str | None = None,
    ) -> BatchPlan:
        now = self.clock.now_ms()
        message = build_message(
            subject, body, tags=tags, properties=properties, id=id, delay=delay, at=at, key=key,
            now_ms=now, limits=self.limits, check=False,
        )  # fmt: skip
        return plan_frames([message], now_ms=now, limits=self.limits)

    def plan(self, messages: Iterable[Message]) -> BatchPlan:
        batch = messages if isinstance(messages, Sequence) else list(messages)
        return plan_frames(
            batch,
            now_ms=self.clock.now_ms(),
            limits=self.limits,
            max_bytes=self.batch_bytes,
            max_messages=self.batch_messages,
        )

    def answered(self, frame: OutgoingFrame, metadata: Mapping[str, Any]) -> None:
        results = check_results(frame, metadata)
        self._frames += 1
        self._messages += len(results)
        if frame.route == RouteKind.DELAYED_PRODUCER:
            self._delayed += len(results)
        self._duplicates += results.count("duplicate")

    def statistics(self, routes: RouteClientStatistics) -> ProducerStatistics:
        return ProducerStatistics(
            messages=self._messages,
            immediate=self._messages - self._delayed,
            delayed=self._delayed,
            duplicates=self._duplicates,
            frames=self._frames,
            routes=routes,
        )


class Producer(ProducerCore):
    """Sends messages from trio code. Build it with ``open_producer``."""

    def __init__(self, routes: RouteClient, *, peers: AsyncCaller | None = None, **options: Any) -> None:
        super().__init__(**options)
        self.routes = routes
        self._peers = peers  # CANCEL / MOVE / QUERY go to named groups, not through the route's round robin

    async def send(
        self,
        subject: str,
        body: bytes | str = b"",
        *,
        tags: Iterable[str] = (),
        properties: Mapping[str, Any] | None = None,
        id: str | None = None,
        delay: Delay | None = None,
        at: At | None = None,
        key: str | None = None,
    ) -> SentId:
        """Send one message; returns its id once a server has stored (or scheduled) it.

        ``delay`` (seconds or ``timedelta``) or ``at`` (aware ``datetime`` or
        epoch ms) in the future schedules it; otherwise it is delivered now.
        ``id`` is made here unless given (a non-empty str). ``key`` is a business
        key (1 to 256 UTF-8 bytes, the property ``key``): ``cancel``, ``move`` and
        ``query`` by ``subject=`` and ``key=`` reach every message sent with it.
        The id returned is a ``str`` whose ``group`` names the scheduler group that
        stored a delayed message. ``LocalProtocolError`` names a broken field or
        limit (nothing was sent); ``NoRouteError``, ``CallFailed`` (``CallTimedOut``
        after ``send_timeout``) or ``PeerError`` say why no server took it.
        """
        plan = self.plan_one(subject, body, tags=tags, properties=properties, id=id, delay=delay, at=at, key=key)
        return (await self._send_plan(plan))[0]

    async def send_batch(self, messages: Iterable[Message]) -> list[SentId]:
        """Send many messages (see ``message``) in as few requests as the limits allow.

        All are checked before any is sent. Returns their ids (``SentId``), in
        order. Each request is retried for up to ``send_timeout``. If one fails,
        the ones before it were stored: send the same messages again, and the
        servers drop the ids they already hold.
        """
        plan = self.plan(messages)
        return await self._send_plan(plan)

    async def _send_plan(self, plan: BatchPlan) -> list[SentId]:
        groups: list[str | None] = [None] * len(plan.ids)
        for frame in plan.frames:
            try:
                answer = await self.routes.call(
                    frame.route, frame.command, {}, frame.body, attempts=self.attempts, timeout=self.timeout,
                    retry_for=self.send_timeout, retry_for_name="send_timeout",
                )  # fmt: skip
            except PeerError as error:
                raise with_batch_index(error, frame) from None
            self.answered(frame, answer.metadata)
            group = answer.metadata.get("group")
            if frame.command == Command.SCHEDULE and isinstance(group, str) and group:
                for index in frame.indexes:
                    groups[index] = group
        return SentId.many(plan.ids, groups)

    # -- cancel, move, query --------------------------------------------------

    async def cancel(
        self,
        ids: str | Iterable[str] | None = None,
        *,
        subject: str | None = None,
        key: str | None = None,
        group: str | None = None,
    ) -> list[MessageState]:
        """Cancel scheduled messages: by id (one or many), or every one sent with ``subject`` and ``key``.

        Returns one ``MessageState`` per id: "cancelled" (it will not be delivered),
        "delivered" (too late: ``dispatched_at`` says when) or "unknown" (no
        scheduler group holds it). By key: one per message that key names. A
        cancel is durable when answered. ``group`` asks only that scheduler group
        (``SentId.group``); without it every scheduler group is asked. Retried
        through failovers for up to ``send_timeout``.
        """
        return await self._scheduled(Command.CANCEL, ids, subject=subject, key=key, group=group)

    async def move(
        self,
        ids: str | Iterable[str] | None = None,
        *,
        subject: str | None = None,
        key: str | None = None,
        delay: Delay | None = None,
        at: At | None = None,
        group: str | None = None,
    ) -> list[MessageState]:
        """Deliver scheduled messages at another time (``delay`` from now, or ``at``); they keep id and body.

        Names messages as ``cancel`` does. Per id: "moved" (``deliver_at`` is the
        new time), "delivered" or "unknown". A time in the past means now; one
        beyond the horizon is refused naming ``deliver_at``.
        """
        now = self.clock.now_ms()
        deliver_at = delivery_time(delay=delay, at=at, now_ms=now)
        if deliver_at is None:
            raise LocalProtocolError("move needs delay= or at=: the new delivery time", code="bad_value", field="at")
        check_horizon(deliver_at, now, self.limits)
        extra = {"deliver_at": deliver_at}
        return await self._scheduled(Command.MOVE, ids, subject=subject, key=key, group=group, extra=extra)

    async def query(
        self,
        ids: str | Iterable[str] | None = None,
        *,
        subject: str | None = None,
        key: str | None = None,
        group: str | None = None,
    ) -> list[MessageState]:
        """Where scheduled messages are: "scheduled" (for ``deliver_at``, in ``hour`` on
        ``group``), "delivered" (at ``dispatched_at`` to ``realtime_group``),
        "cancelled" or "unknown". Names messages as ``cancel`` does.

        The ids the scheduler groups answer "delivered" (or "unknown": an immediate
        message) are then looked up in every realtime group too: ``realtime_group``
        says which stored it and ``consumer_groups`` what each consumer group of its
        subject did with it ("acked", "handed out", "waiting"), while the realtime
        group still remembers it (docs/cancel.md); an immediate message a realtime
        group placed answers "delivered".
        """
        states = await self._scheduled(Command.QUERY, ids, subject=subject, key=key, group=group)
        asked = [state.id for state in states if state.state in ("delivered", "unknown")]
        if not asked:
            return states
        assert self._peers is not None  # ``_scheduled`` checked it
        realtime = GroupCalls(
            self.routes,
            self._peers,
            clock=self.clock,
            timeout=self.timeout,
            retry_for=self.send_timeout,
            route=RouteKind.CONSUMER,
        )
        return with_locations(states, await realtime.locate(asked))

    async def _scheduled(
        self,
        command: Command,
        ids: str | Iterable[str] | None,
        *,
        subject: str | None,
        key: str | None,
        group: str | None,
        extra: dict[str, Any] | None = None,
    ) -> list[MessageState]:
        selection = select(ids, subject=subject, key=key, limits=self.limits)
        if self._peers is None:
            raise RuntimeError("this producer has no connections of its own: build it with open_producer")
        calls = GroupCalls(
            self.routes, self._peers, clock=self.clock, timeout=self.timeout, retry_for=self.send_timeout
        )
        return await calls.call(command, selection, extra or {}, group=group)

    def statistics(self) -> ProducerStatistics:  # type: ignore[override]
        return super().statistics(self.routes.statistics())


@asynccontextmanager
async def open_producer(
    meta: str | Sequence[str] = DEFAULT_META,
    *,
    clock: Clock | None = None,
    limits: Limits = DEFAULT_LIMITS,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
    batch_messages: int = DEFAULT_BATCH_MESSAGES,
    attempts: int = 3,
    timeout: float = 10.0,
    send_timeout: float = DEFAULT_SEND_TIMEOUT,
    connect_timeout: float = 5.0,
    route_refresh: float = 30.0,
    peers: AsyncCaller | None = None,
) -> AsyncIterator[Producer]:
    """A producer whose connections close when the block ends.

    ``meta``: the metaserver address(es). ``batch_bytes``/``batch_messages``
    cap one request of ``send_batch``. ``timeout`` bounds each try of a
    request; ``send_timeout`` how long a request keeps being retried (other
    groups first, then with backoff) before the send fails; ``attempts`` how
    many groups one round of retries tries before it backs off. ``peers``
    replaces the TCP connections (in-memory ones in tests).
    """
    addresses = meta_addresses(meta)
    clock = clock if clock is not None else SystemClock()
    options: dict[str, Any] = {
        "clock": clock, "limits": limits, "batch_bytes": batch_bytes, "batch_messages": batch_messages,
        "attempts": attempts, "timeout": timeout, "send_timeout": send_timeout,
    }  # fmt: skip
    # Checked here, so a bad option is a ValueError, not an ExceptionGroup out of open_peers' nursery.
    check_options(attempts=attempts, batch_bytes=batch_bytes, batch_messages=batch_messages,
                  send_timeout=send_timeout)  # fmt: skip
    refresh_ms = round(route_refresh * 1000)
    if peers is not None:
        routes = RouteClient(peers, addresses, clock=clock, refresh_interval_ms=refresh_ms)
        yield Producer(routes, peers=peers, **options)
        return
    async with open_peers(
        limits=limits, connect_timeout=connect_timeout, request_timeout=timeout, **CLIENT_PEERS_OPTIONS
    ) as tcp:
        yield Producer(RouteClient(tcp, addresses, clock=clock, refresh_interval_ms=refresh_ms), peers=tcp, **options)


__all__ = [
    "DEFAULT_META",
    "DEFAULT_SEND_TIMEOUT",
    "MessageState",
    "Producer",
    "ProducerCore",
    "ProducerStatistics",
    "SentId",
    "open_producer",
]
