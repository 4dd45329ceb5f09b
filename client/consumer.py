"""The consumer, for trio code: ``open_consumer(meta, subject, group=...)``, then iterate.

One task pulls from each realtime group of the ``consumer`` route (long polls,
so a message arrives as soon as it is stored), and one more the group's retry
subject there (``%retry%<group>%<subject>``, where nacked messages come back
after their delay; see ``delaymq.client.retry``), a task re-reads the route and
starts or stops pullers as groups come and go (``delaymq.client.pullers``), one
sends acks and nacks in batches of ``[start, end)`` pull-log ranges (a round at
most every ``SETTLE_INTERVAL``, its requests on the way together, so they share
the server's checkpoints; ``delaymq.client.acksender``), one sends CONSUMER_HEARTBEAT.
The decisions (what to pull, the exact tag filter, flow control, ack ranges)
are ``delaymq.client.delivery.ConsumerCore``'s, shared with the blocking twin.
What arrives waits in a ``ReleaseQueue`` (``delaymq.client.release``): a message
fetched ahead of its ``deliver_at`` (``fetch_ahead``) is handed to the application
when this process's clock reads it.

Every request goes to the group's address as the route says now. A replicated
group's master may change (a failover): the new master holds the same pull
logs, so the same ranges are acked there. A request refused with ``not_master``
(or another "try again" code) or left unanswered marks its group as lost: the
route is asked again, after 50 ms and then at most every ``ROUTE_RETRY`` seconds, until
the group answers; acks and nacks that did not go stay queued and are sent again after
a backoff (``SETTLE_BACKOFF``), pulls after theirs (``PULL_BACKOFF``). When the
route moves a group, a long poll still held by its old address is given up and
the waits end at once, so nothing waits on a master that is gone.

Example::

    async with open_consumer("127.0.0.1:20880", "orders", group="billing", tags=["paid"]) as consumer:
        async for message in consumer:
            print(message.id, message.body)
            await message.ack()

    # or: handler returns -> ack; handler raises -> nack (and the error is logged)
    async with open_consumer(meta, "orders", group="billing", retry_delays=(1, 10, 60), max_attempts=5) as consumer:
        await consumer.run(handle_order)

A nacked message comes back after the next of ``retry_delays`` (the last one
repeats), with ``attempts`` one higher; the nack of its ``max_attempts``-th
delivery sends it to ``%dead%<group>%<subject>`` instead, a subject like any
other. ``limit=N`` pulls at most N messages in all (each PULL asks for no more
than is left), and iteration ends once they are handed out.

When the block ends the consumer gives back what it holds, at once, to the
servers it came from, and flushes the acks not sent yet (within ``flush_timeout``):
messages it received and never handed to the application are **released**
(NACK with ``release``: ``attempts`` unchanged, no retry delay, never
dead-lettered), and so is whatever a PULL still on its way when it stopped may
have been handed (a release to the end of its pull log, which also ends its
pulls; it is answered before anything else goes back, so none of them takes
that back); messages handed out and not settled are nacked (back at once,
``attempts`` one higher). What a server did not take in time comes back after
its ack timeout, as for a consumer that died; the close logs how many.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

import trio

from delaymq.client.acksender import AckSender
from delaymq.client.acksender import send_failure as send_failure
from delaymq.client.delivery import (
    DEFAULT_FETCH_AHEAD,
    ConsumerCore,
    ConsumerStatistics,
    ReceivedMessage,
    fetch_ahead_ms,
)
from delaymq.client.pullers import POLL_MARGIN as POLL_MARGIN
from delaymq.client.pullers import ROUTE_RETRY as ROUTE_RETRY
from delaymq.client.pullers import GroupPullers
from delaymq.client.pullers import is_retryable as is_retryable
from delaymq.client.release import ReleaseQueue
from delaymq.client.retry import DEFAULT_MAX_ATTEMPTS, DEFAULT_RETRY_DELAYS
from delaymq.client.routes import CLIENT_PEERS_OPTIONS, RouteClient, meta_addresses
from delaymq.clock import Clock, SystemClock
from delaymq.net.connection import TransportError
from delaymq.net.limits import DEFAULT_LIMITS, Limits
from delaymq.net.peers import Peers, open_peers
from delaymq.protocol.errors import ProtocolError
from delaymq.protocol.limits import MiB
from delaymq.protocol.routes import RouteAnswer, RouteKind

log = logging.getLogger(__name__)

Handler = Callable[[ReceivedMessage], Awaitable[Any] | Any]


class ConsumerFailed(Exception):
    """A server refused this consumer's pulls in a way retrying cannot fix (see ``__cause__``)."""


class Consumer:
    """Receives messages of one subject for one consumer group. Build it with ``open_consumer``."""

    def __init__(
        self,
        core: ConsumerCore,
        *,
        routes: RouteClient,
        peers: Peers,
        clock: Clock,
        heartbeat_interval: float,
        route_refresh: float,
        peers_options: dict[str, Any] | None = None,
    ) -> None:
        self.core = core
        self._peers_options = peers_options or {}
        self.routes = routes
        self._peers = peers
        self._clock = clock
        self._route_ms = round(route_refresh * 1000)
        # One item per PULL answer (never empty), not per message: a batch crosses in one hop.
        self._send, self._receive = trio.open_memory_channel[list[ReceivedMessage]](math.inf)
        # Taken from the channel, not handed out yet; held there until due when fetched ahead.
        self._queue = ReleaseQueue(ahead_ms=core.fetch_ahead_ms)
        self._groups = GroupPullers(
            core, routes=routes, peers=peers, clock=clock, heartbeat_interval=heartbeat_interval,
            route_refresh=route_refresh, deliver=self._send.send_nowait, settle=self._settle,
            want_settle=self._want_settle, fail=self._fail, undelivered=self.release_unread, finished=self.stop,
        )  # fmt: skip
        self._acks = AckSender(
            core, moved=lambda: self._groups.moved, answered=self._groups.answered, failed=self._groups.request_failed
        )
        self._failure: BaseException | None = None

    # -- receiving --------------------------------------------------------------

    def __aiter__(self) -> Consumer:
        return self

    async def __anext__(self) -> ReceivedMessage:
        try:
            return await self.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None

    async def receive(self) -> ReceivedMessage:
        """The next message; ``trio.EndOfChannel`` once closed, ``ConsumerFailed`` if refused.

        Messages already here are handed out with a cancellation check each and a
        full checkpoint only when it waits (a scheduler round per message would
        cost more than everything else a message takes).
        """
        return (await self.receive_batch(1))[0]

    async def receive_batch(self, max_messages: int | None = None) -> list[ReceivedMessage]:
        """Wait for a message that is due, then take every one already here and due (up to ``max_messages``).

        A message fetched ahead of its ``deliver_at`` (``fetch_ahead``) is held until then.
        """
        if max_messages is not None and max_messages < 1:
            raise ValueError(f"max_messages is {max_messages}; give at least 1, or None for all that are here")
        queue, channel, clock = self._queue, self._receive, self._clock
        # Before anything is taken: a cancelled call must leave every message where it was.
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            closed = False
            while True:
                try:
                    queue.add(channel.receive_nowait(), clock.now_ms())
                except trio.WouldBlock:
                    break
                except (trio.EndOfChannel, trio.ClosedResourceError):
                    closed = True
                    break
            now = clock.now_ms()
            batch = queue.take(now, max_messages)
            if batch:
                return batch  # (no checkpoint from the take on: a cancel cannot drop them)
            release = queue.next_release()
            if closed:
                if release is None:
                    if self._failure is not None:
                        raise ConsumerFailed(str(self._failure)) from self._failure
                    raise trio.EndOfChannel
                await clock.sleep_until_ms(release)
                continue
            # An arrival, or the first held message falling due, whichever comes first.
            with trio.move_on_after(math.inf if release is None else (release - now) / 1000):
                try:
                    queue.add(await channel.receive(), clock.now_ms())
                except (trio.EndOfChannel, trio.ClosedResourceError):
                    pass  # seen as closed above, next time round

    async def ack(self, message: ReceivedMessage) -> None:
        """Done with ``message`` (same as ``await message.ack()``); sent in the next ack batch."""
        await self._settle(message, True)

    async def nack(self, message: ReceivedMessage) -> None:
        """Not done with ``message`` (same as ``await message.nack()``): it is retried later, or dead.

        It comes back after the retry delay for its ``attempts``, or goes to the
        dead-letter subject after the last attempt (see ``open_consumer``).
        """
        await self._settle(message, False)

    async def _settle(self, message: ReceivedMessage, ack: bool) -> None:
        # A local mark (the ack travels in the next batch), so no full checkpoint:
        # yielding to the scheduler for every message would cost more than the rest.
        await trio.lowlevel.checkpoint_if_cancelled()
        if self.core.settle(message, ack):
            self._acks.want()
            self._groups.room.unpark_all()

    async def run(self, handler: Handler, *, concurrency: int = 1) -> None:
        """Hand every message to ``handler`` until stopped: it returns → ack, it raises → nack.

        ``handler`` may be a coroutine function or a plain one. With
        ``concurrency`` > 1 that many messages are handled at once.
        """
        if concurrency < 1:
            raise ValueError(f"concurrency is {concurrency}, must be at least 1")
        limit = trio.Semaphore(concurrency)

        async def handle(message: ReceivedMessage) -> None:
            try:
                result = handler(message)
                if inspect.isawaitable(result):
                    await result
            except Exception:
                log.exception("handler failed on message %s (attempt %d); nacked", message.id, message.attempts)
                await self.nack(message)
            else:
                await self.ack(message)
            finally:
                limit.release()

        failure: ConsumerFailed | None = None
        async with trio.open_nursery() as nursery:
            try:
                async for message in self:
                    await limit.acquire()
                    nursery.start_soon(handle, message)
            except ConsumerFailed as error:
                failure = error  # raised below, not inside an ExceptionGroup
        if failure is not None:
            raise failure

    def release_unread(self, messages: Iterable[ReceivedMessage]) -> int:
        """Give back messages taken from this consumer that no application code saw (a
        wrapper's buffer as it closes): the group gets them at once, ``attempts`` unchanged.

        Only for messages never handed to a handler: a message that was worked on is
        acked or nacked. Sent with the next ack round; returns how many were held.
        """
        released = self.core.release(messages)
        if released:
            self._acks.want()
            self._groups.room.unpark_all()
        return released

    async def flush(self) -> bool:
        """Send every ack and nack not sent yet; False if some could not be (they stay queued)."""
        return await self._acks.flush(self._peers)

    def stop(self) -> None:
        """Pull no more: iteration (and ``run``) ends once the messages already received are handed out.

        What is held when the ``open_consumer`` block ends goes back to the group: released
        if it was never handed out, nacked if it was and is not settled.
        """
        self._groups.stop()
        self._send.close()

    def statistics(self) -> ConsumerStatistics:
        return self.core.statistics()

    # -- tasks --------------------------------------------------------------------

    def _start(self, nursery: trio.Nursery, answer: RouteAnswer) -> None:
        self._groups.start(nursery, answer)
        nursery.start_soon(self._acks.run, self._peers)
        nursery.start_soon(self._groups.heartbeat_loop)

    def _want_settle(self) -> None:
        self._acks.want()

    def _fail(self, error: BaseException) -> None:
        log.error("consumer %s stops: %s", self.core.consumer_id, error)
        if self._failure is None:
            self._failure = error
        self.stop()

    @asynccontextmanager
    async def _running(self, answer: RouteAnswer, flush_timeout: float) -> AsyncIterator[None]:
        """Run the consumer's tasks around the caller's block; close (give back, flush) as it ends."""
        body_error: Exception | None = None
        async with trio.open_nursery() as nursery:
            self._start(nursery, answer)
            try:
                yield
            except Exception as error:
                body_error = error  # raised below, not inside an ExceptionGroup
            finally:
                with trio.CancelScope(shield=True):
                    await self._close(flush_timeout)
                nursery.cancel_scope.cancel()
        if body_error is not None:
            raise body_error

    async def _close(self, flush_timeout: float) -> None:
        """Stop, give back what is held (see the module docstring) and flush, within ``flush_timeout``."""
        self.stop()
        core = self.core
        released = core.release(self._take_unread())
        nacked = core.release_all()
        core.release_rest()
        if released or nacked:
            log.info("consumer %s: gave back %d message(s) never handed out and %d handed out, not settled",
                     core.consumer_id, released, nacked)  # fmt: skip
        # Fresh connections: when the consumer closes because its caller was
        # cancelled, the tasks reading the old ones are cancelled too.
        sent = False
        with trio.move_on_after(flush_timeout):
            async with self._acks.lock:
                if core.has_pending():
                    async with open_peers(**self._peers_options) as peers:
                        sent = await self._flush_following_routes(peers)
                else:
                    sent = True
        if not sent:
            back, rest, acks = core.unsent()
            log.warning(
                "consumer %s: could not give back %d message(s)%s or send %d ack(s) before closing; the servers "
                "hand them out again after their ack timeout", core.consumer_id, back,
                f" (nor what {rest} unread pull answer(s) held)" if rest else "", acks,
            )  # fmt: skip

    def _take_unread(self) -> list[ReceivedMessage]:
        """Every message received and not handed out (on its way here, or in the release queue)."""
        while True:
            try:
                self._queue.add(self._receive.receive_nowait(), self._clock.now_ms())
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
        return self._queue.drain()

    async def _flush_following_routes(self, peers: Peers) -> bool:
        """Send what is pending; True if all of it went.

        After a round that could not send everything the route is asked again
        (over ``peers``): if a group has moved (a failover during the close),
        what it refused goes to its new address. A group that is just down
        does not hold the close up.
        """
        routes = RouteClient(peers, self.routes.table.meta_addresses, clock=self._clock,
                             refresh_interval_ms=self._route_ms)  # fmt: skip
        while not await self._acks.send_round(peers):
            try:
                answer = await routes.groups(RouteKind.CONSUMER)
            except (TransportError, ProtocolError, LookupError) as error:
                log.info("consumer %s: route refresh failed while closing: %s", self.core.consumer_id, error)
                return False
            before = {name: link.address for name, link in self.core.links.items()}
            self.core.update_route((group.group, group.address) for group in answer.groups)
            if not self._groups.follow_moves(before):
                return False
        return True


@asynccontextmanager
async def open_consumer(
    meta: str | Sequence[str],
    subject: str,
    *,
    group: str,
    tags: Iterable[str] = (),
    broadcast: bool = False,
    start: str = "latest",
    max_messages_held: int = 1000,
    max_bytes_held: int = 64 * MiB,
    limit: int | None = None,
    pull_batch: int = 100,
    poll_timeout: float = 30.0,
    fetch_ahead: float = DEFAULT_FETCH_AHEAD,
    retry_delays: Sequence[float | timedelta] = DEFAULT_RETRY_DELAYS,
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    consumer_id: str | None = None,
    heartbeat_interval: float = 5.0,
    route_refresh: float = 10.0,
    flush_timeout: float = 5.0,
    clock: Clock | None = None,
    limits: Limits = DEFAULT_LIMITS,
    connect_timeout: float = 5.0,
    request_timeout: float = 10.0,
) -> AsyncIterator[Consumer]:
    """A consumer of ``subject`` in consumer group ``group``, pulling until the block ends.

    ``tags``: receive only messages carrying one of them. ``broadcast``: this
    consumer gets every message (its own read position) instead of sharing
    the group's. ``start``: where a new group begins, ``"latest"`` (messages
    stored from now on) or ``"earliest"``. Pulls stop while
    ``max_messages_held`` messages or ``max_bytes_held`` body bytes are held
    (received, not acked or nacked). ``limit``: pull at most this many messages in
    all (a message the exact tag check drops counts too), then stop; iteration ends
    once they are handed out. ``fetch_ahead`` (seconds, 0 to 1, default
    0.2): take messages a scheduler sent ahead up to that long before they are due
    and hold them here until this process's clock reads their ``deliver_at``
    (fewer pulls; 0 leaves the holding to the server). ``consumer_id`` names this consumer to
    the servers (default: host-pid-random); reuse one to take over what an
    earlier run held. ``retry_delays`` (seconds or timedeltas; default 5 s,
    10 s, 30 s, 1 min, 2 min, 5 min, 10 min, 30 min, 1 h, then 2 h) and
    ``max_attempts`` (default 16) are the group's retry policy: give every
    consumer of a group the same. Raises ``NoRouteError`` when no metaserver answers.
    """
    core = ConsumerCore(
        subject, group=group, consumer_id=consumer_id, tags=tags, broadcast=broadcast, start=start,
        max_messages_held=max_messages_held, max_bytes_held=max_bytes_held, pull_batch=pull_batch,
        poll_timeout_ms=round(poll_timeout * 1000), fetch_ahead_ms=fetch_ahead_ms(fetch_ahead),
        retry_delays=retry_delays, max_attempts=max_attempts, limits=limits, limit=limit,
    )  # fmt: skip
    addresses = meta_addresses(meta)
    clock = clock if clock is not None else SystemClock()
    peers_options: dict[str, Any] = {
        "limits": limits, "connect_timeout": connect_timeout, "request_timeout": request_timeout,
        **CLIENT_PEERS_OPTIONS,  # each loop below paces its own retries (pulls: PULL_BACKOFF)
    }  # fmt: skip
    async with open_peers(**peers_options) as peers:
        routes = RouteClient(peers, addresses, clock=clock, refresh_interval_ms=round(route_refresh * 1000))
        consumer = Consumer(
            core, routes=routes, peers=peers, clock=clock, heartbeat_interval=heartbeat_interval,
            route_refresh=route_refresh, peers_options=peers_options,
        )  # fmt: skip
        answer = await routes.groups(RouteKind.CONSUMER)  # before the nursery: errors stay unwrapped
        async with consumer._running(answer, flush_timeout):
            yield consumer


__all__ = ["Consumer", "ConsumerFailed", "Handler", "open_consumer"]
