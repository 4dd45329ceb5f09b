"""The blocking twins of ``Producer`` and ``Consumer``, for plain (threaded) code.

They make the same decisions as the trio clients (``ProducerCore`` and
``ConsumerCore``), over ``BlockingRouteClient`` and ``BlockingPeers``.

Example::

    with BlockingProducer("127.0.0.1:20880") as producer:
        producer.send("orders", b"hello", tags=["paid"])
        producer.send("orders", b"later", delay=90)

    with BlockingConsumer("127.0.0.1:20880", "orders", group="billing") as consumer:
        for message in consumer.messages(timeout=5):  # stops after 5 s without a message
            print(message.id, message.body)
            consumer.ack(message)  # or message.ack()

The consumer runs a thread per realtime group that pulls (each with its own
connection, so a long poll never holds up an ack), one more per group for the
group's retry subject (where nacked messages come back after their retry
delay; see ``open_consumer``), and one housekeeping thread
that sends acks in batches, heartbeats and re-reads the route. Blocking
sockets cannot be woken, so ``close()`` waits for the pulls in flight; pulls
therefore poll in short rounds (``poll_timeout``, default 1 s).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any

from delaymq.client.consumer import POLL_MARGIN, ConsumerFailed, is_retryable, send_failure
from delaymq.client.delivery import ConsumerCore, ConsumerStatistics, ReceivedMessage, Settlement
from delaymq.client.messages import DEFAULT_BATCH_BYTES, DEFAULT_BATCH_MESSAGES, At, BatchPlan, Delay, with_batch_index
from delaymq.client.producer import DEFAULT_META, DEFAULT_SEND_TIMEOUT, ProducerCore, ProducerStatistics
from delaymq.client.retry import DEFAULT_MAX_ATTEMPTS, DEFAULT_RETRY_DELAYS
from delaymq.client.routes import BlockingRouteClient, meta_addresses
from delaymq.metaserver.routes import RouteAnswer, RouteKind
from delaymq.protocol.blocking import BlockingPeers
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import PeerError, ProtocolError
from delaymq.protocol.limits import DEFAULT_LIMITS, MiB, Limits
from delaymq.protocol.records import Message
from delaymq.protocol.transport import TransportError
from delaymq.wheel.clock import Clock, SystemClock

log = logging.getLogger(__name__)


class BlockingProducer(ProducerCore):
    """``Producer`` for plain code: ``send`` and ``send_batch`` block until stored.

    Takes the options of ``open_producer``; the backoff between retries blocks the calling thread.
    """

    def __init__(
        self,
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
    ) -> None:
        addresses = meta_addresses(meta)
        clock = clock if clock is not None else SystemClock()
        super().__init__(
            clock=clock,
            limits=limits,
            batch_bytes=batch_bytes,
            batch_messages=batch_messages,
            attempts=attempts,
            timeout=timeout,
            send_timeout=send_timeout,
        )
        self._peers = BlockingPeers(limits=limits, connect_timeout=connect_timeout, request_timeout=timeout)
        self.routes = BlockingRouteClient(
            self._peers, addresses, clock=clock, refresh_interval_ms=round(route_refresh * 1000)
        )

    def send(
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
        """Send one message; returns its id (see ``Producer.send``)."""
        plan = self.plan_one(subject, body, tags=tags, properties=properties, id=id, delay=delay, at=at)
        self._send_plan(plan)
        return plan.ids[0]

    def send_batch(self, messages: Iterable[Message]) -> list[str]:
        """Send many messages built with ``message()``; returns their ids (see ``Producer.send_batch``)."""
        plan = self.plan(messages)
        self._send_plan(plan)
        return plan.ids

    def _send_plan(self, plan: BatchPlan) -> None:
        for frame in plan.frames:
            try:
                answer = self.routes.call(
                    frame.route, frame.command, {}, frame.body, attempts=self.attempts, timeout=self.timeout,
                    retry_for=self.send_timeout, retry_for_name="send_timeout",
                )  # fmt: skip
            except PeerError as error:
                raise with_batch_index(error, frame) from None
            self.answered(frame, answer.metadata)

    def statistics(self) -> ProducerStatistics:  # type: ignore[override]
        return super().statistics(self.routes.statistics())

    def close(self) -> None:
        self._peers.close()

    def __enter__(self) -> BlockingProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BlockingConsumer:
    """``Consumer`` for plain code. Starts pulling on ``start()``, ``with`` or the first receive.

    Takes the options of ``open_consumer`` (``retry_delays`` and ``max_attempts`` too).
    """

    def __init__(
        self,
        meta: str | Sequence[str],
        subject: str,
        *,
        group: str,
        tags: Iterable[str] = (),
        broadcast: bool = False,
        start: str = "latest",
        max_messages_held: int = 1000,
        max_bytes_held: int = 64 * MiB,
        pull_batch: int = 100,
        poll_timeout: float = 1.0,
        retry_delays: Sequence[float | timedelta] = DEFAULT_RETRY_DELAYS,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        consumer_id: str | None = None,
        heartbeat_interval: float = 5.0,
        route_refresh: float = 10.0,
        clock: Clock | None = None,
        limits: Limits = DEFAULT_LIMITS,
        connect_timeout: float = 5.0,
        request_timeout: float = 10.0,
    ) -> None:
        self.core = ConsumerCore(
            subject,
            group=group,
            consumer_id=consumer_id,
            tags=tags,
            broadcast=broadcast,
            start=start,
            max_messages_held=max_messages_held,
            max_bytes_held=max_bytes_held,
            pull_batch=pull_batch,
            poll_timeout_ms=round(poll_timeout * 1000),
            retry_delays=retry_delays,
            max_attempts=max_attempts,
            limits=limits,
        )
        self._clock = clock if clock is not None else SystemClock()
        self._limits = limits
        self._connect_timeout = connect_timeout
        self._request_timeout = request_timeout
        self._heartbeat_interval = heartbeat_interval
        self._route_refresh = route_refresh
        self._control = BlockingPeers(limits=limits, connect_timeout=connect_timeout, request_timeout=request_timeout)
        self.routes = BlockingRouteClient(
            self._control, meta_addresses(meta), clock=self._clock, refresh_interval_ms=round(route_refresh * 1000)
        )
        self._lock = threading.Condition()  # guards core; notified when room frees or acks wait
        self._settle_lock = threading.Lock()  # one settle round at a time
        self._queue: queue.SimpleQueue[ReceivedMessage | None] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._pullers: dict[tuple[str, bool], threading.Thread] = {}  # (group, retry subject?)
        self._housekeeper: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._started = False
        self._closed = False

    # -- life ---------------------------------------------------------------------

    def start(self) -> None:
        """Read the route and start pulling; ``NoRouteError`` when no metaserver answers."""
        with self._lock:
            if self._started:
                return
            if self._closed:
                raise RuntimeError("the consumer is closed")
            self._started = True
        try:
            self._apply_route(self.routes.groups(RouteKind.CONSUMER))
        except BaseException:
            with self._lock:
                self._started = False
            raise
        self._housekeeper = threading.Thread(target=self._housekeep, name="delaymq-consumer-housekeeper", daemon=True)
        self._housekeeper.start()

    def close(self) -> None:
        """Stop pulling, give back what is held and not acked, send the acks not sent yet."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._stop.set()
            self._lock.notify_all()
        for thread in list(self._pullers.values()):
            thread.join(self.core.poll_timeout_ms / 1000 + POLL_MARGIN)
        with self._lock:
            released = self.core.release_all()
        if released:
            log.info("consumer %s: gave back %d unacked message(s)", self.core.consumer_id, released)
        if self._housekeeper is not None:
            self._housekeeper.join()
        if not self.flush():
            log.warning("consumer %s: some acks could not be sent before closing", self.core.consumer_id)
        self._queue.put(None)
        self._control.close()

    def __enter__(self) -> BlockingConsumer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- receiving ----------------------------------------------------------------

    def receive(self, timeout: float | None = None) -> ReceivedMessage | None:
        """The next message, or None after ``timeout`` seconds without one (or once closed)."""
        self.start()
        try:
            message = self._queue.get(timeout=timeout)
        except queue.Empty:
            message = None
        if message is None:
            if not self._closed and self._failure is None:
                return None
            self._queue.put(None)  # wake the next reader too
            if self._failure is not None:
                raise ConsumerFailed(str(self._failure)) from self._failure
        return message

    def messages(self, timeout: float | None = None) -> Iterator[ReceivedMessage]:
        """Messages as they come; stops after ``timeout`` seconds without one, or when closed."""
        while True:
            message = self.receive(timeout)
            if message is None:
                return
            yield message

    def ack(self, message: ReceivedMessage) -> None:
        """Done with ``message`` (same as ``message.ack()``); sent in the next ack batch."""
        self._settle(message, True)

    def nack(self, message: ReceivedMessage) -> None:
        """Not done with ``message`` (same as ``message.nack()``): retried after a delay, or dead."""
        self._settle(message, False)

    def _settle(self, message: ReceivedMessage, ack: bool) -> None:
        with self._lock:
            if self.core.settle(message, ack):
                self._lock.notify_all()

    def run(self, handler: Callable[[ReceivedMessage], Any], *, timeout: float | None = None) -> None:
        """Hand messages to ``handler``: it returns → ack, it raises → nack (logged).

        Stops after ``timeout`` seconds without a message (never, if None) or when closed.
        """
        for message in self.messages(timeout):
            try:
                handler(message)
            except Exception:
                log.exception("handler failed on message %s (attempt %d); nacked", message.id, message.attempts)
                self.nack(message)
            else:
                self.ack(message)

    def flush(self) -> bool:
        """Send every ack and nack not sent yet; False if some could not be (they stay queued)."""
        with self._settle_lock:
            with self._lock:
                settlements = self.core.take_pending()
            return all([self._send_settlement(settlement) for settlement in settlements])

    def statistics(self) -> ConsumerStatistics:
        with self._lock:
            return self.core.statistics()

    # -- threads ------------------------------------------------------------------

    def _apply_route(self, answer: RouteAnswer) -> None:
        with self._lock:
            if self._stop.is_set():
                return
            _, stopped = self.core.update_route((group.group, group.address) for group in answer.groups)
            self._lock.notify_all()  # stopped pullers waiting for room notice it
        for name in stopped:
            log.info("consumer %s: group %s left the route; stop pulling it", self.core.consumer_id, name)
        with self._lock:
            active = [name for name, link in self.core.links.items() if link.active]
        for name in active:
            for lane in self.core.lanes:
                old = self._pullers.get((name, lane))
                if old is not None and old.is_alive():
                    continue  # pulling (or finishing its last poll; it sees the group active again)
                thread_name = f"delaymq-pull-{name}{'-retry' if lane else ''}"
                thread = threading.Thread(target=self._pull, args=(name, lane), name=thread_name, daemon=True)
                self._pullers[(name, lane)] = thread
                thread.start()
        if not any(link.active for link in self.core.links.values()):
            log.warning("consumer %s: no realtime group serves consumers yet; waiting", self.core.consumer_id)

    def _pull(self, name: str, retry: bool) -> None:
        """Pull one subject (``retry``: the group's retry subject) from one group."""
        core = self.core
        timeout = core.poll_timeout_ms / 1000 + POLL_MARGIN
        with BlockingPeers(
            limits=self._limits, connect_timeout=self._connect_timeout, request_timeout=timeout
        ) as peers:
            while True:
                with self._lock:
                    while True:
                        link = core.links[name]
                        if self._stop.is_set() or not link.active:
                            return
                        request = core.pull_request(name, retry=retry)
                        if request is not None:
                            break
                        self._lock.wait()
                    address = link.address
                try:
                    frame = peers.call(address, Command.PULL, request, timeout=timeout)
                    with self._lock:
                        now = self._clock.now_ms()
                        messages = core.accept_pull(name, frame.metadata, frame.body, now, self._settle, retry=retry)
                        if core.has_pending():
                            self._lock.notify_all()
                except (PeerError, TransportError, ProtocolError) as error:
                    if not is_retryable(error):
                        self._fail(error)
                        return
                    with self._lock:
                        backoff = core.pull_failed(name, retry=retry)
                    log.info("consumer %s: pull of %s from group %s failed (%s); retry in %d ms",
                             core.consumer_id, request["subject"], name, error, backoff)  # fmt: skip
                    self._stop.wait(backoff / 1000)
                    continue
                for message in messages:
                    self._queue.put(message)

    def _fail(self, error: BaseException) -> None:
        log.error("consumer %s stops: %s", self.core.consumer_id, error)
        with self._lock:
            if self._failure is None:
                self._failure = error
            self._stop.set()
            self._lock.notify_all()
        self._queue.put(None)

    def _housekeep(self) -> None:
        """Acks as they are settled, heartbeats and route re-reads when due, until closed."""
        now = time.monotonic()
        next_beat = now + self._heartbeat_interval
        next_route = now + self._route_refresh
        retry_at = 0.0
        while not self._stop.is_set():
            with self._lock:
                while not self._stop.is_set():
                    now = time.monotonic()
                    due = min(next_beat, next_route)
                    if (self.core.has_pending() and now >= retry_at) or now >= due:
                        break
                    wake = due if not self.core.has_pending() else min(due, retry_at)
                    self._lock.wait(max(0.0, wake - now))
            if self._stop.is_set():
                return
            if self.core.has_pending() and time.monotonic() >= retry_at:
                if not self.flush():
                    retry_at = time.monotonic() + 1.0
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + self._heartbeat_interval
                self._heartbeat()
            if now >= next_route:
                next_route = now + self._route_refresh
                try:
                    self._apply_route(self.routes.groups(RouteKind.CONSUMER))
                except (TransportError, ProtocolError, LookupError) as error:
                    log.info("consumer %s: route refresh failed: %s", self.core.consumer_id, error)

    def _heartbeat(self) -> None:
        with self._lock:
            targets = self.core.heartbeat_targets()
            metadata = self.core.heartbeat_metadata()
        for name, address in targets:
            try:
                self._control.call(address, Command.CONSUMER_HEARTBEAT, metadata)
            except (PeerError, TransportError) as error:
                log.debug("consumer %s: heartbeat to %s failed: %s", self.core.consumer_id, name, error)

    def _send_settlement(self, settlement: Settlement) -> bool:
        core = self.core
        unsent = settlement.requests()
        while unsent:
            request = unsent[0]
            command = Command.ACK if request.ack else Command.NACK
            try:
                self._control.call(settlement.address, command, core.settle_metadata(settlement, request))
            except (PeerError, TransportError) as error:
                if send_failure(settlement, error):
                    with self._lock:
                        core.settle_failed(settlement, unsent)
                    return False
            unsent.pop(0)
        return True


__all__ = ["BlockingConsumer", "BlockingProducer"]
