"""The producer, for trio code: ``open_producer(meta) as producer``, then ``send``.

A message due now goes to a realtime group (route ``immediate-producer``,
command SEND); one due later (``delay=`` or ``at=``) to a scheduler group
(route ``delayed-producer``, command SCHEDULE) with its ``deliver_at``. Every
message is checked here before anything is sent, and gets its id here, so a
batch refused by one group and retried on another is stored once (servers
drop ids they already hold). Routes, group choice, avoidance of slow groups
and retries are the route client's (``delaymq.client.routes``).

Example::

    async with open_producer("127.0.0.1:20880") as producer:
        order_id = await producer.send("orders", b'{"id": 7}', tags=["paid"])
        reminder = await producer.send("reminders", "call back", delay=timedelta(hours=2))
        ids = await producer.send_batch(
            [producer.message("orders", f"order {n}", at=datetime(2026, 12, 24, tzinfo=timezone.utc))
             for n in range(100)]
        )
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
    build_message,
    check_results,
    plan_frames,
    with_batch_index,
)
from delaymq.client.routes import RouteClient, RouteClientStatistics, meta_addresses
from delaymq.metaserver.routes import RouteKind
from delaymq.protocol.errors import PeerError
from delaymq.protocol.limits import DEFAULT_LIMITS, Limits
from delaymq.protocol.records import Message
from delaymq.protocol.transport import open_peers
from delaymq.wheel.clock import Clock, SystemClock

#: Where a client finds the metaserver unless told otherwise.
DEFAULT_META = "127.0.0.1:20880"


@dataclass(frozen=True, slots=True)
class ProducerStatistics:
    messages: int  # messages the servers answered for
    immediate: int  # of them, sent to realtime groups
    delayed: int  # of them, scheduled
    duplicates: int  # answered "duplicate": the server already held that id
    frames: int  # requests answered
    routes: RouteClientStatistics


class ProducerCore:
    """What both producers share: building and checking messages, planning frames, counting answers."""

    def __init__(
        self,
        *,
        clock: Clock,
        limits: Limits,
        batch_bytes: int,
        batch_messages: int,
        attempts: int,
        timeout: float | None,
    ) -> None:
        if attempts < 1:
            raise ValueError(f"attempts is {attempts}, must be at least 1")
        if batch_bytes < 1 or batch_messages < 1:
            raise ValueError(f"batch_bytes ({batch_bytes}) and batch_messages ({batch_messages}) must be at least 1")
        self.clock = clock
        self.limits = limits
        self.batch_bytes = batch_bytes
        self.batch_messages = batch_messages
        self.attempts = attempts
        self.timeout = timeout
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
    ) -> Message:
        """A checked message for ``send_batch``, with its id and ``deliver_at`` fixed now.

        ``delay`` is seconds or a ``timedelta``; ``at`` an aware ``datetime`` or
        epoch ms. Keep the message to retry a failed ``send_batch``: the same
        ids are stored once.
        """
        return build_message(
            subject,
            body,
            tags=tags,
            properties=properties,
            id=id,
            delay=delay,
            at=at,
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
    ) -> BatchPlan:
        now = self.clock.now_ms()
        message = build_message(
            subject, body, tags=tags, properties=properties, id=id, delay=delay, at=at,
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

    def __init__(self, routes: RouteClient, **options: Any) -> None:
        super().__init__(**options)
        self.routes = routes

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
    ) -> str:
        """Send one message; returns its id once a server has stored (or scheduled) it.

        ``delay`` (seconds or ``timedelta``) or ``at`` (aware ``datetime`` or
        epoch ms) in the future schedules it; otherwise it is delivered now.
        ``LocalProtocolError`` names a broken field or limit (nothing was sent);
        ``NoRouteError``, ``CallFailed`` or ``PeerError`` say why no server took it.
        """
        plan = self.plan_one(subject, body, tags=tags, properties=properties, id=id, delay=delay, at=at)
        await self._send_plan(plan)
        return plan.ids[0]

    async def send_batch(self, messages: Iterable[Message]) -> list[str]:
        """Send many messages (see ``message``) in as few requests as the limits allow.

        All are checked before any is sent. Returns their ids, in order. If a
        request fails, the ones before it were stored: send the same messages
        again, and the servers drop the ids they already hold.
        """
        plan = self.plan(messages)
        await self._send_plan(plan)
        return plan.ids

    async def _send_plan(self, plan: BatchPlan) -> None:
        for frame in plan.frames:
            try:
                answer = await self.routes.call(
                    frame.route, frame.command, {}, frame.body, attempts=self.attempts, timeout=self.timeout
                )
            except PeerError as error:
                raise with_batch_index(error, frame) from None
            self.answered(frame, answer.metadata)

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
    connect_timeout: float = 5.0,
    route_refresh: float = 30.0,
) -> AsyncIterator[Producer]:
    """A producer whose connections close when the block ends.

    ``meta``: the metaserver address(es). ``batch_bytes``/``batch_messages``
    cap one request of ``send_batch``; ``attempts`` is how many groups a
    request may try; ``timeout`` bounds each try.
    """
    addresses = meta_addresses(meta)
    clock = clock if clock is not None else SystemClock()
    async with open_peers(limits=limits, connect_timeout=connect_timeout, request_timeout=timeout) as peers:
        routes = RouteClient(peers, addresses, clock=clock, refresh_interval_ms=round(route_refresh * 1000))
        yield Producer(
            routes,
            clock=clock,
            limits=limits,
            batch_bytes=batch_bytes,
            batch_messages=batch_messages,
            attempts=attempts,
            timeout=timeout,
        )


__all__ = ["DEFAULT_META", "Producer", "ProducerCore", "ProducerStatistics", "open_producer"]
