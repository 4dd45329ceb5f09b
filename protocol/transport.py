"""The trio transport shared by every server and client.

The frame codec (``frames.py``) is sans-IO; this module does the I/O around it:

- ``serve_frames`` answers requests on a TCP listener, one task per request so a
  long poll does not hold up the requests behind it on the same connection. An
  unknown command, a malformed frame or a request that breaks a limit is
  answered with an error frame; the connection is closed only when the byte
  stream itself can no longer be trusted, and other connections never notice.
- ``open_peers`` keeps one reused connection per peer address, matches
  responses to requests by request id, times out each request, and after a
  failed connect waits out a growing backoff before it dials that peer again.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import trio

from delaymq.protocol.commands import command_name
from delaymq.protocol.errors import PeerError, ProtocolError, RemoteProtocolError
from delaymq.protocol.frames import (
    Frame,
    FrameDecoder,
    FrameKind,
    encode_frame,
    error_response,
    request,
    response_error,
    response_to,
)
from delaymq.protocol.limits import DEFAULT_LIMITS, Limits

log = logging.getLogger(__name__)

#: What a handler returns: response metadata, or (metadata, body).
Reply = dict[str, Any] | tuple[dict[str, Any], bytes] | None
Handler = Callable[["Request"], Awaitable[Reply]]

RECEIVE_SIZE = 256 * 1024
#: Requests one connection may have in flight before the server stops reading it.
MAX_IN_FLIGHT = 1024


class TransportError(Exception):
    """A request could not be completed: the peer is unreachable or too slow."""

    def __init__(self, message: str, *, address: str) -> None:
        super().__init__(message)
        self.address = address


class PeerUnavailable(TransportError):
    """Connecting failed, the connection broke, or the peer is in its backoff."""


class RequestTimeout(TransportError):
    """No response within the request's timeout."""


@dataclass(frozen=True, slots=True)
class Request:
    """One request as a handler sees it."""

    frame: Frame
    peer: str

    @property
    def metadata(self) -> dict[str, Any]:
        return self.frame.metadata

    @property
    def body(self) -> bytes:
        return self.frame.body

    def batch_body(self) -> bytes:
        """The records of a batch command (SEND, SCHEDULE): it takes no metadata, and some bytes.

        ``RemoteProtocolError`` (``bad_request``) names the field that is wrong.
        """
        command = command_name(self.frame.command)
        if self.metadata:
            key = next(iter(self.metadata))
            raise RemoteProtocolError(
                f"{command}: unknown field {key!r} ({command} takes no metadata; the batch is the body)",
                code="bad_request",
                field=key,
            )
        if not self.body:
            raise RemoteProtocolError(f"{command}: the body holds no records", code="bad_request", field="body")
        return self.body


def parse_address(address: str) -> tuple[str, int]:
    """``"host:port"`` (IPv6 in brackets) as (host, port), with a clear error."""
    return _host_port(address, "address", lowest_port=1)


def split_listen(listen: str) -> tuple[str, int]:
    """A listen address ``"host:port"`` as (host, port); port 0 asks for any free port."""
    return _host_port(listen, "listen address", lowest_port=0)


def _host_port(text: str, what: str, *, lowest_port: int) -> tuple[str, int]:
    host, sep, port_text = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port_text.isdigit() or not lowest_port <= int(port_text) <= 65535:
        raise ValueError(f"{what} {text!r} is not HOST:PORT with a port from {lowest_port} to 65535")
    return host, int(port_text)


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# ------------------------------------------------------------------- serving


@dataclass(frozen=True, slots=True)
class ServerStatistics:
    connections_open: int
    connections_total: int
    requests: int
    errors_answered: int
    connections_dropped: int


class FrameServer:
    """Serves ``handlers`` (command code → handler) to every connection."""

    def __init__(self, handlers: Mapping[int, Handler], *, limits: Limits = DEFAULT_LIMITS) -> None:
        self.handlers = dict(handlers)
        self.limits = limits
        self._open = 0
        self._total = 0
        self._requests = 0
        self._errors = 0
        self._dropped = 0

    def statistics(self) -> ServerStatistics:
        return ServerStatistics(self._open, self._total, self._requests, self._errors, self._dropped)

    async def serve(
        self, host: str = "127.0.0.1", port: int = 0, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Listen and serve until cancelled; ``nursery.start`` gets the bound address."""
        listeners = await trio.open_tcp_listeners(port, host=host)
        sockname = listeners[0].socket.getsockname()
        address = format_address(sockname[0], sockname[1])
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.serve_listeners, self.serve_stream, listeners)
            task_status.started(address)

    async def serve_stream(self, stream: trio.abc.Stream) -> None:
        """Serve one connection until the peer leaves or its bytes stop making sense."""
        peer = _peer_name(stream)
        self._open += 1
        self._total += 1
        try:
            async with trio.open_nursery() as nursery:
                connection = _ServedConnection(self, stream, peer, nursery)
                try:
                    await connection.read_requests()
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    # Gone without a goodbye (reset: a killed process). Left to escape,
                    # the error would reach the listener inside an exception group, and
                    # ``serve_listeners`` would stop the whole server.
                    log.debug("connection from %s broke", peer)
                # The peer is gone or dropped: its answers cannot be delivered, so a
                # long poll must not go on holding what it would hand out.
                nursery.cancel_scope.cancel()
        finally:
            self._open -= 1
            await trio.aclose_forcefully(stream)

    async def _answer(self, frame: Frame, peer: str) -> Frame | None:
        expects_answer = frame.kind == FrameKind.REQUEST
        if frame.kind == FrameKind.RESPONSE:
            error = RemoteProtocolError(
                f"a response frame ({command_name(frame.command)}) sent to a server",
                code="bad_frame",
                field="kind",
            )
            self._errors += 1
            return error_response(frame, error)
        handler = self.handlers.get(frame.command)
        try:
            if handler is None:
                known = ", ".join(command_name(code) for code in sorted(self.handlers))
                raise RemoteProtocolError(
                    f"unknown command {command_name(frame.command)} (this server serves {known})",
                    code="bad_request",
                    field="command",
                )
            reply = await handler(Request(frame, peer))
        except ProtocolError as error:
            self._errors += 1
            log.info("refused %s from %s: %s", command_name(frame.command), peer, error)
            return error_response(frame, error) if expects_answer else None
        except Exception as error:  # a bug in a handler must not kill the server
            self._errors += 1
            log.exception("%s from %s failed", command_name(frame.command), peer)
            internal = RemoteProtocolError(f"internal error: {type(error).__name__}: {error}", code="internal")
            return error_response(frame, internal) if expects_answer else None
        if not expects_answer:
            return None
        if reply is None:
            return response_to(frame)
        if isinstance(reply, tuple):
            return response_to(frame, reply[0], reply[1])
        return response_to(frame, reply)


class _ServedConnection:
    """One client's connection on the server side: read frames, answer each in its own task."""

    def __init__(self, server: FrameServer, stream: trio.abc.Stream, peer: str, nursery: trio.Nursery) -> None:
        self._server = server
        self._stream = stream
        self._peer = peer
        self._nursery = nursery
        self._decoder = FrameDecoder(server.limits)
        self._send_lock = trio.Lock()
        self._in_flight = trio.Semaphore(MAX_IN_FLIGHT)

    async def read_requests(self) -> None:
        """Until end of stream; a fatal protocol error is answered, then ends it."""
        try:
            while data := await self._stream.receive_some(RECEIVE_SIZE):
                self._decoder.feed(data)
                await self._start_handlers()
            self._decoder.end_of_stream()
        except ProtocolError as error:
            # The stream can no longer be trusted: say why, then close.
            self._server._errors += 1
            self._server._dropped += 1
            log.warning("closing connection from %s: %s", self._peer, error)
            with trio.move_on_after(1):
                await self._send(error_response((error.command or 0, error.request_id or 0), error))

    async def _start_handlers(self) -> None:
        while True:
            try:
                frame = self._decoder.next_frame()
            except ProtocolError as error:
                if error.fatal:
                    raise
                self._server._errors += 1
                log.info("bad frame from %s: %s", self._peer, error)
                await self._send(error_response(error, error))
                continue
            if frame is None:
                return
            self._server._requests += 1
            await self._in_flight.acquire()  # backpressure: stop reading this peer
            self._nursery.start_soon(self._handle, frame)

    async def _handle(self, frame: Frame) -> None:
        try:
            answer = await self._server._answer(frame, self._peer)
            if answer is not None:
                await self._send(answer)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            self._in_flight.release()

    async def _send(self, frame: Frame) -> None:
        data = encode_frame(frame, self._server.limits)
        async with self._send_lock:
            await self._stream.send_all(data)


def _peer_name(stream: trio.abc.Stream) -> str:
    try:
        host, port = stream.socket.getpeername()[:2]  # type: ignore[attr-defined]
        return format_address(host, port)
    except (AttributeError, OSError):
        return "?"


# ------------------------------------------------------------------- calling


class Connection:
    """One connection to a peer; requests on it run concurrently."""

    def __init__(self, address: str, stream: trio.abc.Stream, *, limits: Limits) -> None:
        self.address = address
        self._stream = stream
        self._limits = limits
        self._ids = itertools.count(1)
        self._waiting: dict[int, trio.MemorySendChannel[Frame | BaseException]] = {}
        self._send_lock = trio.Lock()
        self.closed = False

    async def call(
        self, command: int, metadata: dict[str, Any] | None = None, body: bytes = b"", *, timeout: float
    ) -> Frame:
        """Send a request and return its response; an error response raises ``PeerError``."""
        request_id = next(self._ids) & 0xFFFF_FFFF
        send_channel, receive_channel = trio.open_memory_channel[Frame | BaseException](1)
        self._waiting[request_id] = send_channel
        try:
            data = encode_frame(request(command, request_id, metadata, body), self._limits)
            with trio.move_on_after(timeout) as scope:
                await self._send(data)
                answer = await receive_channel.receive()
            if scope.cancelled_caught:
                raise RequestTimeout(
                    f"{command_name(command)} to {self.address} got no answer within {timeout:g} s",
                    address=self.address,
                )
        finally:
            self._waiting.pop(request_id, None)
        if isinstance(answer, BaseException):
            raise PeerUnavailable(f"connection to {self.address} lost: {answer}", address=self.address) from answer
        error = response_error(answer)
        if error is not None:
            raise error
        return answer

    async def _send(self, data: bytes) -> None:
        try:
            async with self._send_lock:
                await self._stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as error:
            self.closed = True
            raise PeerUnavailable(f"connection to {self.address} lost: {error}", address=self.address) from error

    async def read_responses(self) -> None:
        """Route each response to its caller until the stream ends."""
        decoder = FrameDecoder(self._limits)
        reason: BaseException = PeerUnavailable(f"{self.address} closed the connection", address=self.address)
        try:
            while True:
                data = await self._stream.receive_some(RECEIVE_SIZE)
                if not data:
                    break
                decoder.feed(data)
                for frame in decoder:
                    waiter = self._waiting.get(frame.request_id)
                    if waiter is not None:
                        waiter.send_nowait(frame)
        except (trio.BrokenResourceError, trio.ClosedResourceError, ProtocolError) as error:
            reason = error
        finally:
            self.closed = True
            for waiter in list(self._waiting.values()):
                try:
                    waiter.send_nowait(reason)
                except trio.WouldBlock:
                    pass
            await trio.aclose_forcefully(self._stream)


class AsyncCaller(Protocol):
    """What a client of one peer at a time needs of ``Peers``: a request to an address."""

    async def call(
        self,
        address: str,
        command: int,
        metadata: dict[str, Any] | None = ...,
        body: bytes = ...,
        *,
        timeout: float | None = ...,
    ) -> Frame: ...


class ConnectBackoff:
    """After a failed connect, how long a peer is left alone, per address.

    The delay doubles from ``initial`` up to ``maximum`` seconds and is forgotten
    on a connect. Sans-IO (fed the time in seconds), so ``Peers`` and
    ``BlockingPeers`` back off alike.
    """

    __slots__ = ("initial", "maximum", "_waits")

    def __init__(self, initial: float, maximum: float) -> None:
        self.initial = initial
        self.maximum = maximum
        self._waits: dict[str, tuple[float, float]] = {}  # address -> (retry at, current delay)

    def check(self, address: str, now: float) -> None:
        """``PeerUnavailable`` while ``address`` is in its backoff."""
        wait = self._waits.get(address)
        if wait is not None and now < wait[0]:
            raise PeerUnavailable(f"{address} is unreachable; next attempt in {wait[0] - now:.2f} s", address=address)

    def failed(self, address: str, now: float) -> None:
        _, delay = self._waits.get(address, (0.0, 0.0))
        delay = min(self.maximum, max(self.initial, delay * 2))
        self._waits[address] = (now + delay, delay)

    def connected(self, address: str) -> None:
        self._waits.pop(address, None)


@dataclass(frozen=True, slots=True)
class PeersStatistics:
    connections: int
    connects: int
    connect_failures: int
    requests: int


class Peers:
    """One reused connection per peer address, redialled with backoff."""

    def __init__(
        self,
        nursery: trio.Nursery,
        *,
        limits: Limits = DEFAULT_LIMITS,
        connect_timeout: float = 5.0,
        request_timeout: float = 10.0,
        backoff_initial: float = 0.1,
        backoff_max: float = 5.0,
    ) -> None:
        self._nursery = nursery
        self._limits = limits
        self._connect_timeout = connect_timeout
        self.request_timeout = request_timeout
        self._backoff = ConnectBackoff(backoff_initial, backoff_max)
        self._connections: dict[str, Connection] = {}
        self._dialing: dict[str, trio.Event] = {}
        self._connects = 0
        self._failures = 0
        self._requests = 0

    def statistics(self) -> PeersStatistics:
        return PeersStatistics(len(self._connections), self._connects, self._failures, self._requests)

    async def call(
        self,
        address: str,
        command: int,
        metadata: dict[str, Any] | None = None,
        body: bytes = b"",
        *,
        timeout: float | None = None,
    ) -> Frame:
        """One request to ``address``; raises ``TransportError`` or ``PeerError``."""
        self._requests += 1
        timeout = self.request_timeout if timeout is None else timeout
        connection = await self._connection(address)
        return await connection.call(command, metadata, body, timeout=timeout)

    async def _connection(self, address: str) -> Connection:
        while True:
            connection = self._connections.get(address)
            if connection is not None and not connection.closed:
                return connection
            dialing = self._dialing.get(address)
            if dialing is None:
                break
            await dialing.wait()
        self._backoff.check(address, trio.current_time())
        done = self._dialing[address] = trio.Event()
        try:
            host, port = parse_address(address)
            with trio.fail_after(self._connect_timeout):
                stream = await trio.open_tcp_stream(host, port)
        except (OSError, trio.TooSlowError, ValueError) as error:
            self._failures += 1
            self._backoff.failed(address, trio.current_time())
            raise PeerUnavailable(f"cannot connect to {address}: {error or type(error).__name__}", address=address) from error
        finally:
            del self._dialing[address]
            done.set()
        self._connects += 1
        self._backoff.connected(address)
        connection = Connection(address, stream, limits=self._limits)
        self._connections[address] = connection
        self._nursery.start_soon(connection.read_responses)
        return connection

    async def aclose(self) -> None:
        for connection in self._connections.values():
            await trio.aclose_forcefully(connection._stream)
        self._connections.clear()


@asynccontextmanager
async def open_peers(**options: Any) -> AsyncIterator[Peers]:
    """A ``Peers`` whose connections close when the block ends."""
    async with trio.open_nursery() as nursery:
        peers = Peers(nursery, **options)
        try:
            yield peers
        finally:
            await peers.aclose()
            nursery.cancel_scope.cancel()


__all__ = [
    "AsyncCaller",
    "ConnectBackoff",
    "Connection",
    "FrameServer",
    "Handler",
    "PeerError",
    "PeerUnavailable",
    "Peers",
    "Reply",
    "Request",
    "RequestTimeout",
    "TransportError",
    "format_address",
    "open_peers",
    "parse_address",
    "split_listen",
]
