"""The trio transport shared by every server and client.

The frame codec (``frames.py``) is sans-IO; this module does the I/O around it:

- ``FrameServer`` answers requests on a TCP listener, one task per request so a
  long poll does not hold up the requests behind it on the same connection. An
  unknown command, a malformed frame or a request that breaks a limit is
  answered with an error frame; the connection is closed only when the byte
  stream itself can no longer be trusted, and other connections never notice.
  What connections may hold is capped (``ConnectionLimits``, decided by the
  sans-IO ``connections.ConnectionAdmission``): in all, per client address,
  file descriptors, idle time, slow frames, bytes of unfinished frames; past a
  cap a client is told ``unavailable`` and the connection closed, so a flood
  neither locks other clients out nor takes the server's memory.
- ``open_peers`` keeps one reused connection per peer address, matches
  responses to requests by request id, times out each request, and after a
  failed connect waits out a growing backoff before it dials that peer again.
"""

from __future__ import annotations

import errno
import itertools
import logging
import math
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import trio

from delaymq.protocol.backoff import Backoff, BackoffRun, RandomSource
from delaymq.protocol.commands import command_name
from delaymq.protocol.connections import (
    Admitted,
    ConnectionAdmission,
    Refusal,
    RefusalLog,
    open_file_limit,
)
from delaymq.protocol.errors import (
    LocalProtocolError,
    PeerError,
    ProtocolError,
    RemoteProtocolError,
    sole,
)
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
#: The request id of an error frame about the connection itself (a refusal), not a request.
CONNECTION_REQUEST_ID = 0


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

    def batch_body(self, *, fields: tuple[str, ...] = ()) -> bytes:
        """The records of a batch command (SEND, SCHEDULE): no metadata but ``fields``, and some bytes.

        ``RemoteProtocolError`` (``bad_request``) names the field that is wrong.
        """
        command = command_name(self.frame.command)
        key = next((key for key in self.metadata if key not in fields), None) if self.metadata else None
        if key is not None:
            takes = f"no metadata but {', '.join(fields)}" if fields else "no metadata"
            raise RemoteProtocolError(
                f"{command}: unknown field {key!r} ({command} takes {takes}; the batch is the body)",
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

#: accept(2) errors that mean "out of descriptors or memory", not "this listener is broken".
ACCEPT_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
#: Descriptors a serving ``FrameServer`` holds open on /dev/null, let go when accept finds none free.
RESERVED_FDS = 2
#: How long a refusal may take to write before the connection is closed without it.
REFUSAL_WRITE_TIMEOUT = 1.0
#: How long the accept loop waits when accept fails and no reserved descriptor helps.
ACCEPT_RETRY_DELAY = 0.1


@dataclass(frozen=True, slots=True)
class ServerStatistics:
    connections_open: int
    connections_total: int
    requests: int
    errors_answered: int
    connections_dropped: int
    #: Connections refused at ``ConnectionLimits.max_connections``.
    refused_at_connection_cap: int
    #: ... at ``max_per_address``.
    refused_at_address_cap: int
    #: ... because the process's file descriptors ran low (``spare_fds``), or accept found none.
    refused_for_file_descriptors: int
    #: Connections closed because their half-sent frame went past ``max_buffered``.
    refused_for_buffered_bytes: int
    #: Connections closed after ``idle_timeout`` with nothing in flight.
    closed_idle: int
    #: Connections closed because a frame took longer than ``frame_timeout`` to arrive or be written.
    closed_slow: int
    #: Bytes of unfinished frames held now, and the most held at once.
    buffered_bytes: int
    buffered_bytes_peak: int


class FrameServer:
    """Serves ``handlers`` (command code → handler) to every connection.

    ``limits.connections`` caps what clients' connections may hold (see
    ``ConnectionLimits``): past a cap a connection is answered with an
    ``unavailable`` error frame and closed, never left hanging.
    """

    def __init__(self, handlers: Mapping[int, Handler], *, limits: Limits = DEFAULT_LIMITS) -> None:
        self.handlers = dict(handlers)
        self.limits = limits
        self.admission = ConnectionAdmission(limits.connections, max_frame=limits.max_frame, fd_limit=open_file_limit())
        self._refusal_log = RefusalLog()
        self._requests = 0
        self._errors = 0
        self._dropped = 0
        self._closed_idle = 0
        self._closed_slow = 0

    def statistics(self) -> ServerStatistics:
        admission = self.admission
        refused = admission.refused
        return ServerStatistics(
            connections_open=admission.open,
            connections_total=admission.admitted,
            requests=self._requests,
            errors_answered=self._errors,
            connections_dropped=self._dropped,
            refused_at_connection_cap=refused["connections"],
            refused_at_address_cap=refused["connections_per_address"],
            refused_for_file_descriptors=refused["file_descriptors"],
            refused_for_buffered_bytes=refused["buffered_bytes"],
            closed_idle=self._closed_idle,
            closed_slow=self._closed_slow,
            buffered_bytes=admission.buffered,
            buffered_bytes_peak=admission.buffered_peak,
        )

    async def serve(
        self, host: str = "127.0.0.1", port: int = 0, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Listen and serve until cancelled; ``nursery.start`` gets the bound address."""
        listeners = await trio.open_tcp_listeners(port, host=host)
        sockname = listeners[0].socket.getsockname()
        address = format_address(sockname[0], sockname[1])
        reserve = _ReservedFds(RESERVED_FDS)
        try:
            async with trio.open_nursery() as nursery:
                for listener in listeners:
                    nursery.start_soon(self._accept, listener, nursery, reserve)
                task_status.started(address)
        finally:
            reserve.close()

    async def _accept(self, listener: trio.SocketListener, nursery: trio.Nursery, reserve: _ReservedFds) -> None:
        """Accept until cancelled; each connection is served (or refused) in its own task."""
        async with listener:
            while True:
                try:
                    stream = await listener.accept()
                except OSError as error:
                    if error.errno not in ACCEPT_CAPACITY_ERRNOS:
                        raise
                    await self._accept_without_descriptors(listener, nursery, reserve, error)
                    continue
                nursery.start_soon(self.serve_stream, stream)

    async def _accept_without_descriptors(
        self, listener: trio.SocketListener, nursery: trio.Nursery, reserve: _ReservedFds, error: OSError
    ) -> None:
        """Accept failed for want of a descriptor (or memory): answer who waits, instead of spinning.

        Linux fails accept with EMFILE before it looks for a waiting client, so
        this waits for one; then a reserved descriptor is let go so that the
        client can be accepted, told ``unavailable`` and closed, and the reserve
        is taken again. Without this the clients queued on the listener would
        wait unanswered until descriptors came free, while accept failed again
        every time it was tried (trio's ``serve_listeners`` logs a traceback
        each 100 ms of that).
        """
        name = errno.errorcode.get(error.errno or 0, str(error.errno))
        if error.errno not in (errno.EMFILE, errno.ENFILE):  # out of memory: nothing of ours to let go
            self._log_refusal(Refusal("memory", 0, f"accept failed with {name}; retrying"))
            await trio.sleep(ACCEPT_RETRY_DELAY)
            return
        await trio.lowlevel.wait_readable(listener.socket)
        try:
            stream = await listener.accept()  # descriptors may have come free meanwhile
        except OSError as again:
            if again.errno not in ACCEPT_CAPACITY_ERRNOS:
                raise
        else:
            nursery.start_soon(self.serve_stream, stream)
            return
        refusal = Refusal(
            "file_descriptors",
            self.admission.fd_limit or 0,
            f"the server process is out of file descriptors (accept: {name}); try again later",
        )
        if not reserve.release():
            self._log_refusal(refusal)
            await trio.sleep(ACCEPT_RETRY_DELAY)
            reserve.refill()
            return
        try:
            stream = await listener.accept()
        except OSError as again:
            reserve.refill()
            if again.errno not in ACCEPT_CAPACITY_ERRNOS:
                raise
            await trio.sleep(ACCEPT_RETRY_DELAY)
            return
        self.admission.refused["file_descriptors"] += 1
        self._log_refusal(refusal)
        await self._refuse(stream, refusal, write_timeout=0.05)  # closes it: the reserve can be taken again
        reserve.refill()

    async def serve_stream(self, stream: trio.abc.Stream) -> None:
        """Serve one connection until the peer leaves, idles, or its bytes stop making sense."""
        peer = _peer_name(stream)
        host, fd = _peer_host_and_fd(stream)
        admitted = self.admission.admit(host, fd)
        if isinstance(admitted, Refusal):
            self._log_refusal(admitted)
            await self._refuse(stream, admitted, write_timeout=REFUSAL_WRITE_TIMEOUT)
            return
        try:
            async with trio.open_nursery() as nursery:
                connection = _ServedConnection(self, stream, peer, admitted, nursery)
                try:
                    await connection.read_requests()
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    # Gone without a goodbye (reset: a killed process). Left to escape,
                    # the error would reach the accept loop's nursery and stop the server.
                    log.debug("connection from %s broke", peer)
                # The peer is gone or dropped: its answers cannot be delivered, so a
                # long poll must not go on holding what it would hand out.
                nursery.cancel_scope.cancel()
        finally:
            self.admission.close(admitted)
            await trio.aclose_forcefully(stream)

    async def _refuse(self, stream: trio.abc.Stream, refusal: Refusal, *, write_timeout: float) -> None:
        """Tell the client why (an error frame for request 0: the connection), then close."""
        try:
            data = encode_frame(error_response((0, CONNECTION_REQUEST_ID), refusal.error()), self.limits)
            with trio.move_on_after(write_timeout):
                await stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await trio.aclose_forcefully(stream)

    def _log_refusal(self, refusal: Refusal) -> None:
        count = self._refusal_log.note(refusal.cap, trio.current_time())
        if count is not None:
            log.warning("refusing connections: %s (%d refused since the last such line)", refusal.message, count)

    def _log_slow(self, message: str) -> None:
        count = self._refusal_log.note("slow", trio.current_time())
        if count is not None:
            log.warning("closing slow connections: %s (%d closed since the last such line)", message, count)

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
            # A flood of one refusal (a full disk refuses every SEND) is a line a minute with a count.
            count = self._refusal_log.note(f"{frame.command}:{error.code}", trio.current_time())
            if count is not None:
                log.info(
                    "refused %s from %s: %s (%d such refusal(s) since the last such line)",
                    command_name(frame.command), peer, error, count,
                )  # fmt: skip
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
    """One client's connection on the server side: read frames, answer each in its own task.

    The read waits under a deadline that says what the connection owes: the rest
    of a started frame within ``frame_timeout``; nothing while a request is in
    flight (a long poll); otherwise a request within ``idle_timeout`` of the last
    bytes or answer, or it is closed.
    """

    def __init__(
        self, server: FrameServer, stream: trio.abc.Stream, peer: str, admitted: Admitted, nursery: trio.Nursery
    ) -> None:
        self._server = server
        self._stream = stream
        self._peer = peer
        self._admitted = admitted
        self._nursery = nursery
        self._timeouts = server.limits.connections
        self._decoder = FrameDecoder(server.limits)
        self._send_lock = trio.Lock()
        self._in_flight = trio.Semaphore(MAX_IN_FLIGHT)
        self._handling = 0
        self._last_active = trio.current_time()
        self._frame_started = 0.0
        self._read_scope: trio.CancelScope | None = None

    def _read_deadline(self) -> float:
        if self._decoder.pending:
            return self._frame_started + self._timeouts.frame_timeout
        if self._handling:
            return math.inf
        return self._last_active + self._timeouts.idle_timeout

    async def read_requests(self) -> None:
        """Until end of stream or a deadline; a fatal protocol error is answered, then ends it."""
        try:
            while True:
                data: bytes | bytearray = b""
                with trio.CancelScope(deadline=self._read_deadline()) as scope:
                    self._read_scope = scope  # a handler that finishes moves the deadline
                    data = await self._stream.receive_some(RECEIVE_SIZE)
                self._read_scope = None
                if scope.cancelled_caught:
                    await self._timed_out()
                    return
                if not data:
                    break
                if await self._received(data):
                    return
            self._decoder.end_of_stream()
        except ProtocolError as error:
            # The stream can no longer be trusted: say why, then close.
            self._server._errors += 1
            self._server._dropped += 1
            log.warning("closing connection from %s: %s", self._peer, error)
            with trio.move_on_after(1):
                await self._send(error_response((error.command or 0, error.request_id or 0), error))

    async def _received(self, data: bytes | bytearray) -> bool:
        """Hand out the frames ``data`` completes; True when the connection is to be closed."""
        self._last_active = trio.current_time()
        started_before = self._decoder.pending > 0
        self._decoder.feed(data)
        completed = await self._start_handlers()
        pending = self._decoder.pending
        if pending and (completed or not started_before):
            self._frame_started = trio.current_time()
        refusal = self._server.admission.buffer(self._admitted, pending)
        if refusal is None:
            return False
        self._server._log_refusal(refusal)
        await self._give_up_frame(refusal.error())
        return True

    async def _timed_out(self) -> None:
        """The read deadline passed: idle (close quietly) or a frame too slow (answer it, close)."""
        pending = self._decoder.pending
        if not pending:
            self._server._closed_idle += 1
            log.debug("closing connection from %s: idle for %g s", self._peer, self._timeouts.idle_timeout)
            return
        self._server._closed_slow += 1
        partial = self._decoder.partial_frame()
        size = f"of {partial[2]} " if partial else ""
        message = (
            f"a frame was not complete within {self._timeouts.frame_timeout:g} s "
            f"({pending} bytes {size}received); closing the connection"
        )
        self._server._log_slow(f"{message} (from {self._peer})")
        await self._give_up_frame(
            ProtocolError(
                message, code="unavailable", field="frame_timeout", limit=f"{self._timeouts.frame_timeout:g}s"
            )
        )

    async def _give_up_frame(self, error: ProtocolError) -> None:
        """Drop the unfinished frame and answer its request (if its header is in), before closing.

        Its bytes go back to the budget at once: other connections reading while
        this answer is written must not be refused for memory that is let go.
        """
        partial = self._decoder.partial_frame()
        self._decoder.discard()
        self._server.admission.buffer(self._admitted, 0)
        command, request_id = (partial[0], partial[1]) if partial else (0, 0)
        with trio.move_on_after(1):
            await self._send(error_response((command, request_id), error))

    async def _start_handlers(self) -> int:
        """Start a handler for each complete frame; how many frames were complete."""
        completed = 0
        while True:
            try:
                frame = self._decoder.next_frame()
            except ProtocolError as error:
                if error.fatal:
                    raise
                completed += 1
                self._server._errors += 1
                log.info("bad frame from %s: %s", self._peer, error)
                await self._send(error_response(error, error))
                continue
            if frame is None:
                return completed
            completed += 1
            self._server._requests += 1
            await self._in_flight.acquire()  # backpressure: stop reading this peer
            self._handling += 1
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
            self._handling -= 1
            if not self._handling:
                self._last_active = trio.current_time()
                if self._read_scope is not None:
                    self._read_scope.deadline = self._read_deadline()

    async def _send(self, frame: Frame) -> None:
        """Write one frame; one that cannot be written within ``frame_timeout`` closes the connection."""
        try:
            data = encode_frame(frame, self._server.limits)
        except LocalProtocolError as error:  # a handler's answer too big: a bug, not the end of the server
            self._server._errors += 1
            log.error("the answer to %s from %s cannot be sent: %s", command_name(frame.command), self._peer, error)
            internal = ProtocolError(f"internal error: the answer cannot be sent: {error}", code="internal")
            data = encode_frame(error_response(frame, internal), self._server.limits)
        with trio.move_on_after(self._timeouts.frame_timeout) as scope:
            async with self._send_lock:
                await self._stream.send_all(data)
        if scope.cancelled_caught:
            # A peer that does not read its answers holds their memory (and its
            # requests' slots) for ever; a half-written frame also breaks the stream.
            self._server._closed_slow += 1
            self._server._log_slow(
                f"an answer to {self._peer} could not be written within {self._timeouts.frame_timeout:g} s"
            )
            self._nursery.cancel_scope.cancel()
            raise trio.ClosedResourceError("the peer does not read its answers")


def _peer_name(stream: trio.abc.Stream) -> str:
    try:
        host, port = stream.socket.getpeername()[:2]  # type: ignore[attr-defined]
        return format_address(host, port)
    except (AttributeError, OSError):
        return "?"


def _peer_host_and_fd(stream: trio.abc.Stream) -> tuple[str | None, int | None]:
    """The client's host and the connection's descriptor number; None for an in-memory stream."""
    try:
        sock = stream.socket  # type: ignore[attr-defined]
        return str(sock.getpeername()[0]), sock.fileno()
    except (AttributeError, OSError):
        return None, None


class _ReservedFds:
    """A few descriptors held open on /dev/null, to be let go when accept finds none free."""

    def __init__(self, count: int) -> None:
        self._count = count
        self._fds: list[int] = []
        self.refill()

    def refill(self) -> None:
        while len(self._fds) < self._count:
            try:
                self._fds.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
            except OSError:
                return

    def release(self) -> bool:
        """Close one reserved descriptor; False when none is held."""
        if not self._fds:
            return False
        os.close(self._fds.pop())
        return True

    def close(self) -> None:
        while self.release():
            pass


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
        #: Set when the server said why it closes this connection (``unavailable``: at a cap).
        self.refusal: PeerUnavailable | None = None

    async def call(
        self, command: int, metadata: dict[str, Any] | None = None, body: bytes = b"", *, timeout: float
    ) -> Frame:
        """Send a request and return its response; an error response raises ``PeerError``."""
        request_id = next(self._ids) % 0xFFFF_FFFF + 1  # never 0: that one speaks of the connection
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
        if answer is self.refusal and self.refusal is not None:
            raise PeerUnavailable(str(self.refusal), address=self.address)
        if isinstance(answer, BaseException):
            raise PeerUnavailable(f"connection to {self.address} lost: {answer}", address=self.address) from answer
        error = response_error(answer)
        if error is not None:
            raise error
        return answer

    async def _send(self, data: bytes) -> None:
        try:
            async with self._send_lock:
                try:
                    await self._stream.send_all(data)
                except trio.Cancelled:
                    # A frame cut off part way would run into the next request's bytes:
                    # this connection can no longer be trusted (its callers retry).
                    self.closed = True
                    await trio.aclose_forcefully(self._stream)
                    raise
        except (trio.BrokenResourceError, trio.ClosedResourceError) as error:
            self.closed = True
            if self.refusal is not None:
                raise PeerUnavailable(str(self.refusal), address=self.address) from error
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
                    if frame.request_id == CONNECTION_REQUEST_ID:
                        self._refused(frame)
                        continue
                    waiter = self._waiting.get(frame.request_id)
                    if waiter is not None:
                        waiter.send_nowait(frame)
        except (trio.BrokenResourceError, trio.ClosedResourceError, ProtocolError) as error:
            reason = error
        finally:
            self.closed = True
            reason = self.refusal or reason
            for waiter in list(self._waiting.values()):
                try:
                    waiter.send_nowait(reason)
                except trio.WouldBlock:
                    pass
            await trio.aclose_forcefully(self._stream)

    def _refused(self, frame: Frame) -> None:
        """An error frame about the connection (a server at a cap): why it is being closed."""
        error = response_error(frame)
        if error is not None:
            self.refusal = PeerUnavailable(f"{self.address} refused the connection: {error}", address=self.address)


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

    The wait grows from ``initial`` up to ``maximum`` seconds under the one
    ``Backoff`` policy and is forgotten on a connect. Sans-IO (fed the time in
    seconds on trio's clock); ``random`` is the jitter's source (tests fix it).
    """

    __slots__ = ("policy", "_random", "_waits")

    def __init__(self, initial: float, maximum: float, *, random: RandomSource | None = None) -> None:
        if not 0 <= initial <= maximum:
            raise ValueError(
                f"connect backoff: initial ({initial} s) must be 0 or more and at most maximum ({maximum} s)"
            )
        # "equal" jitter: each wait is at least half its ceiling, so the callers of a
        # dead peer never redial it in a tight loop, while the clients of a server
        # that went down still come back to it spread out, not all at once.
        self.policy = Backoff(initial_ms=round(initial * 1000), maximum_ms=round(maximum * 1000), jitter="equal")
        self._random = random
        self._waits: dict[str, tuple[float, BackoffRun]] = {}  # address -> (retry at, its run of failures)

    def retry_at(self, address: str) -> float | None:
        """When ``address`` may be dialled again after its last failed connect; None: it has not failed."""
        wait = self._waits.get(address)
        return None if wait is None else wait[0]

    def check(self, address: str, now: float) -> None:
        """``PeerUnavailable`` while ``address`` is in its backoff."""
        at = self.retry_at(address)
        if at is not None and now < at:
            raise PeerUnavailable(f"{address} is unreachable; next attempt in {at - now:.2f} s", address=address)

    def failed(self, address: str, now: float) -> None:
        wait = self._waits.get(address)
        run = wait[1] if wait is not None else BackoffRun(self.policy, random=self._random)
        self._waits[address] = (now + run.next_delay_ms() / 1000, run)

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
        # The timeout covers connecting too (a dial of a silent address, or waiting for
        # another task's dial), so a caller's deadline holds whatever the network does.
        deadline = trio.current_time() + timeout
        with trio.move_on_at(deadline) as scope:
            connection = await self._connection(address, connect_timeout=min(self._connect_timeout, timeout))
        if scope.cancelled_caught:
            raise RequestTimeout(
                f"{command_name(command)} to {address}: no connection within {timeout:g} s", address=address
            )
        left = deadline - trio.current_time()
        return await connection.call(command, metadata, body, timeout=max(0.001, round(left, 3)))

    async def _connection(self, address: str, *, connect_timeout: float) -> Connection:
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
            with trio.fail_after(connect_timeout):
                stream = await trio.open_tcp_stream(host, port)
        except (OSError, trio.TooSlowError, ValueError) as error:
            self._failures += 1
            self._backoff.failed(address, trio.current_time())
            raise PeerUnavailable(
                f"cannot connect to {address}: {error or type(error).__name__}", address=address
            ) from error
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
    """A ``Peers`` whose connections close when the block ends.

    An exception from the block comes out as itself, not wrapped in the
    exception group of the nursery the connections' readers run in.
    """
    try:
        async with trio.open_nursery() as nursery:
            peers = Peers(nursery, **options)
            try:
                yield peers
            finally:
                await peers.aclose()
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        error = sole(group)
        if error is group:
            raise
        raise error from None


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
