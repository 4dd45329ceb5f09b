"""The clients for plain (threaded) code: ``BlockingProducer``, ``BlockingConsumer``, ``BlockingPeers``.

Each runs its trio client (``open_producer``, ``open_consumer``, ``open_peers``)
on a trio event loop in a background thread of its own (``LoopThread``) and
calls into it with ``trio.from_thread``. So there is one implementation of
every loop, the options and their defaults are the trio client's (taken from
its signature, they cannot drift), and an error raised in the trio code is
raised in the caller's thread as the same exception (``LocalProtocolError``,
``NoRouteError``, ``CallFailed``/``CallTimedOut``, ``PeerError``...).

Example::

    with BlockingProducer("127.0.0.1:20880") as producer:
        producer.send("orders", b"hello", tags=["paid"])
        producer.send("orders", b"later", delay=90)

    with BlockingConsumer("127.0.0.1:20880", "orders", group="billing") as consumer:
        for message in consumer.messages(timeout=5):  # stops after 5 s without a message
            print(message.id, message.body)
            consumer.ack(message)  # or message.ack()

A receive waits on the consumer's real long polls, so a message is handed out
as soon as it arrives. ``close()`` (or the end of the ``with`` block) ends a
receive waiting in another thread at once, gives back what is held and not
settled (released with ``attempts`` unchanged if it was never handed out here,
as the trio ``Consumer`` does), sends the acks not sent yet and ends the loop thread. The thread is a
daemon, so a client never closed does not keep the interpreter from exiting (a
producer or peers dropped without ``close()`` also closes when garbage collected).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import math
import threading
import weakref
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Generic, Self, TypeVar

import trio

from delaymq.client.consumer import Consumer, ConsumerFailed, open_consumer
from delaymq.client.delivery import ConsumerStatistics, ReceivedMessage
from delaymq.client.messages import SentId
from delaymq.client.producer import Producer, ProducerStatistics, open_producer
from delaymq.client.scheduled import MessageState
from delaymq.net.peers import Peers, open_peers
from delaymq.protocol.errors import sole
from delaymq.protocol.frames import Frame
from delaymq.protocol.records import Message

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")
F = TypeVar("F", bound=Callable[..., Any])


class LoopClosed(RuntimeError):
    """The client was closed (before the call, or while it was in flight)."""


class LoopThread(Generic[T]):
    """A trio event loop on a daemon thread, holding one async context (a trio client) open until closed.

    ``value`` is what the context gave. ``run`` calls an async function in the
    loop from any other thread and returns (or raises) what it does.
    """

    def __init__(self, name: str, open_context: Callable[[], AbstractAsyncContextManager[T]]) -> None:
        self.value: T  # what the context gave, once open
        self.token: trio.lowlevel.TrioToken
        self._closing: trio.Event
        self._opened = threading.Event()
        self._error: BaseException | None = None
        self._calls: set[trio.CancelScope] = set()  # calls in flight, cancelled on close
        self._thread = threading.Thread(target=self._run, args=(open_context,), name=name, daemon=True)
        self._thread.start()
        self._opened.wait()
        if self._error is not None:
            self._thread.join()
            error, self._error = self._error, None
            raise error

    def _run(self, open_context: Callable[[], AbstractAsyncContextManager[T]]) -> None:
        try:
            trio.run(self._main, open_context)
        except BaseException as error:  # trio itself failed: __init__ must not wait forever
            self._error = error
        finally:
            self._opened.set()

    async def _main(self, open_context: Callable[[], AbstractAsyncContextManager[T]]) -> None:
        self.token = trio.lowlevel.current_trio_token()
        self._closing = trio.Event()
        try:
            async with open_context() as value:
                self.value = value
                self._opened.set()
                await self._closing.wait()
                for scope in self._calls:
                    scope.cancel()
        except BaseException as error:  # raised in the caller's thread, by __init__ or close
            self._error = sole(error)

    def run(self, afn: Callable[..., Awaitable[R]], *args: Any) -> R:
        """``await afn(*args)`` in the loop; ``LoopClosed`` if the loop closes first."""
        try:
            return trio.from_thread.run(self._call, afn, *args, trio_token=self.token)
        except (trio.RunFinishedError, trio.Cancelled):
            raise LoopClosed("the client is closed") from None

    async def _call(self, afn: Callable[..., Awaitable[R]], *args: Any) -> R:
        with trio.CancelScope() as scope:
            self._calls.add(scope)
            try:
                return await afn(*args)
            except BaseExceptionGroup as group:
                raise sole(group) from None
            finally:
                self._calls.discard(scope)
        raise LoopClosed("the client was closed while this call waited")

    def read(self, fn: Callable[[], R]) -> R:
        """``fn()``, a snapshot of the client's state, taken in the loop whose tasks change that state.

        Taken here once the loop has ended, or when called from trio code (which must not block).
        """
        if not self.running or trio.lowlevel.in_trio_run():
            return fn()
        try:
            return trio.from_thread.run_sync(fn, trio_token=self.token)
        except trio.RunFinishedError:
            return fn()

    def run_sync_soon(self, fn: Callable[..., object], *args: Any) -> None:
        """Call ``fn(*args)`` in the loop soon, without waiting; nothing if the loop has ended."""
        try:
            self.token.run_sync_soon(fn, *args)
        except trio.RunFinishedError:
            pass

    def close_soon(self) -> None:
        """Start closing without waiting (what a garbage-collected client does)."""
        self.run_sync_soon(self._closing.set)

    def close(self) -> None:
        """Cancel calls in flight, leave the context, end the loop; raises what leaving it raised."""
        self.close_soon()
        self._thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise error

    @property
    def running(self) -> bool:
        return self._thread.is_alive()


def same_signature(trio_twin: Callable[..., Any], *, without: Iterable[str] = ()) -> Callable[[F], F]:
    """Give a blocking method ``(self, *args, **options)`` the signature of its trio twin (less ``without``).

    The parameters and their defaults are the trio code's, so the two cannot
    drift; ``help()`` and ``inspect`` show them. An ``__init__`` checks its
    arguments at once (a misspelt option is a ``TypeError`` naming the class);
    other methods pass theirs on to the trio twin, which checks them.
    """
    left_out = set(without)
    twin = inspect.signature(trio_twin)
    parameters = [p for name, p in twin.parameters.items() if name not in left_out]
    if not parameters or parameters[0].name != "self":  # the twin is a function, not a method
        parameters.insert(0, inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY))

    def decorate(method: F) -> F:
        if method.__name__ != "__init__":
            method.__signature__ = twin.replace(parameters=parameters)  # type: ignore[attr-defined]
            return method
        signature = twin.replace(parameters=parameters, return_annotation=None)

        @functools.wraps(method)
        def checked(self: Any, *args: Any, **options: Any) -> None:
            try:
                signature.bind(self, *args, **options)
            except TypeError as error:
                raise TypeError(f"{type(self).__name__}: {error}") from None
            method(self, *args, **options)

        checked.__signature__ = signature  # type: ignore[attr-defined]
        return checked  # type: ignore[return-value]

    return decorate


class OnLoopThread(Generic[T]):
    """A blocking client whose trio twin runs on ``_loop``: closing, and ``with``."""

    _loop: LoopThread[T]

    def close(self) -> None:
        """Close the trio client and end its loop thread."""
        self._loop.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _closes_when_collected(self) -> None:
        weakref.finalize(self, self._loop.close_soon).atexit = False


class BlockingProducer(OnLoopThread[Producer]):
    """``Producer`` for plain code: ``send`` and ``send_batch`` block until stored; ``cancel``,
    ``move`` and ``query`` until answered.

    Takes the options of ``open_producer`` (but ``peers``), with its defaults.
    """

    @same_signature(open_producer, without=("peers",))
    def __init__(self, *args: Any, **options: Any) -> None:
        self._loop = LoopThread("delaymq-producer", functools.partial(open_producer, *args, **options))
        self._closes_when_collected()
        self._producer = producer = self._loop.value
        self.clock = producer.clock
        self.limits = producer.limits
        self.attempts = producer.attempts
        self.timeout = producer.timeout
        self.send_timeout = producer.send_timeout
        #: A checked message for ``send_batch`` (see ``Producer.message``); no I/O, so called here.
        self.message = producer.message

    @same_signature(Producer.send)
    def send(self, *args: Any, **fields: Any) -> SentId:
        """Send one message; returns its id once stored (see ``Producer.send``)."""
        return self._loop.run(functools.partial(self._producer.send, *args, **fields))

    def send_batch(self, messages: Iterable[Message]) -> list[SentId]:
        """Send many messages built with ``message()``; returns their ids (see ``Producer.send_batch``)."""
        return self._loop.run(self._producer.send_batch, messages)

    @same_signature(Producer.cancel)
    def cancel(self, *args: Any, **options: Any) -> list[MessageState]:
        """Cancel scheduled messages by id, or by subject and key (see ``Producer.cancel``)."""
        return self._loop.run(functools.partial(self._producer.cancel, *args, **options))

    @same_signature(Producer.move)
    def move(self, *args: Any, **options: Any) -> list[MessageState]:
        """Move scheduled messages to another time (see ``Producer.move``)."""
        return self._loop.run(functools.partial(self._producer.move, *args, **options))

    @same_signature(Producer.query)
    def query(self, *args: Any, **options: Any) -> list[MessageState]:
        """Where scheduled messages are (see ``Producer.query``)."""
        return self._loop.run(functools.partial(self._producer.query, *args, **options))

    def statistics(self) -> ProducerStatistics:
        return self._loop.read(self._producer.statistics)


class BlockingConsumer:
    """``Consumer`` for plain code. Starts pulling on ``start()``, ``with`` or the first receive.

    Takes the options of ``open_consumer``, with its defaults.
    """

    @same_signature(open_consumer)
    def __init__(self, *args: Any, **options: Any) -> None:
        self._open = functools.partial(open_consumer, *args, **options)
        self._loop: LoopThread[Consumer] | None = None
        self._start_lock = threading.Lock()
        self._closed = False
        self._failure: ConsumerFailed | None = None
        self._ready: deque[ReceivedMessage] = deque()  # received from the loop, not handed out yet
        self._settles: deque[tuple[ReceivedMessage, bool]] = deque()  # settled here, not yet in the loop

    # -- life ---------------------------------------------------------------------

    def start(self) -> None:
        """Read the route and start pulling; ``NoRouteError`` when no metaserver answers."""
        with self._start_lock:
            if self._loop is not None:
                return
            if self._closed:
                raise LoopClosed("the consumer is closed")
            self._loop = LoopThread("delaymq-consumer", self._open_in_loop)

    @asynccontextmanager
    async def _open_in_loop(self) -> AsyncIterator[Consumer]:
        async with self._open() as consumer:
            self._settle_wanted = trio.Event()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._settle_loop, consumer)
                try:
                    yield consumer
                finally:
                    nursery.cancel_scope.cancel()
            await self._apply_settles(consumer)  # settled before close: acked, not given back
            consumer.release_unread(self._take_ready())  # received here, never handed out

    def close(self) -> None:
        """Stop pulling, give back what is held and not acked, send the acks not sent yet."""
        with self._start_lock:
            self._closed = True
            loop = self._loop
        if loop is not None:
            loop.close()
        # Any that reached ``_ready`` as the loop closed went back with the rest: they are
        # the group's again, not this consumer's.
        self._ready.clear()

    def _take_ready(self) -> list[ReceivedMessage]:
        """Take every message received here and not handed out (``popleft`` is safe across threads)."""
        taken: list[ReceivedMessage] = []
        while True:
            try:
                taken.append(self._ready.popleft())
            except IndexError:
                return taken

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- receiving ----------------------------------------------------------------

    def receive(self, timeout: float | None = None) -> ReceivedMessage | None:
        """The next message, or None after ``timeout`` seconds without one (or once closed)."""
        self.start()
        try:
            return self._ready.popleft()
        except IndexError:
            pass
        assert self._loop is not None
        try:
            batch = self._loop.run(self._receive_batch, self._loop.value, timeout)
        except LoopClosed:
            batch = []
        except ConsumerFailed as failure:
            self._failure = failure
            raise
        if not batch:
            if self._closed and self._failure is not None:
                raise ConsumerFailed(str(self._failure)) from self._failure.__cause__
            return None
        messages = [dataclasses.replace(message, settle=self._settle) for message in batch]
        self._ready.extend(messages[1:])
        return messages[0]

    @staticmethod
    async def _receive_batch(consumer: Consumer, timeout: float | None) -> list[ReceivedMessage]:
        with trio.move_on_after(math.inf if timeout is None else timeout):
            try:
                return await consumer.receive_batch()
            except trio.EndOfChannel:  # closed
                pass
        return []

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
        """Queue the settlement for the loop without waiting for it (``flush`` waits)."""
        self._settles.append((message, ack))
        if self._loop is not None:
            self._loop.run_sync_soon(self._wake_settles)

    def _wake_settles(self) -> None:
        self._settle_wanted.set()

    async def _settle_loop(self, consumer: Consumer) -> None:
        while True:
            await self._settle_wanted.wait()
            self._settle_wanted = trio.Event()
            await self._apply_settles(consumer)

    async def _apply_settles(self, consumer: Consumer) -> None:
        """Hand the queued settlements to the trio consumer, all at once (``flush`` and ``close`` see all).

        Settling never waits, so the shield only keeps a cancellation from
        dropping one already taken from the queue.
        """
        with trio.CancelScope(shield=True):
            while self._settles:
                message, ack = self._settles.popleft()
                await (consumer.ack(message) if ack else consumer.nack(message))

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
        self.start()
        assert self._loop is not None
        return self._loop.run(self._flush, self._loop.value)

    async def _flush(self, consumer: Consumer) -> bool:
        await self._apply_settles(consumer)
        return await consumer.flush()

    def statistics(self) -> ConsumerStatistics:
        loop = self._loop
        if loop is None:
            raise LoopClosed("the consumer has not started: call start() or receive() first")
        return loop.read(loop.value.statistics)


class BlockingPeers(OnLoopThread[Peers]):
    """``Peers`` for plain code: one reused connection per peer address, calls block until answered.

    Takes the options of ``Peers``, with its defaults.
    """

    @same_signature(Peers, without=("nursery",))
    def __init__(self, **options: Any) -> None:
        self._loop = LoopThread("delaymq-peers", functools.partial(open_peers, **options))
        self._closes_when_collected()

    @same_signature(Peers.call)
    def call(self, *args: Any, **options: Any) -> Frame:
        """One request to an address (see ``Peers.call``); raises ``TransportError`` or ``PeerError``."""
        return self._loop.run(functools.partial(self._loop.value.call, *args, **options))


__all__ = ["BlockingConsumer", "BlockingPeers", "BlockingProducer", "LoopClosed", "LoopThread", "OnLoopThread"]
