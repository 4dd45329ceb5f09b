"""The server side of the trio transport shared by every server: ``FrameServer``.

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
- ``peers.open_peers`` is the calling side.
- ``Limits.tls`` (``tls.TlsSettings``) secures both: a listener with a
  certificate does a TLS handshake (``trio.SSLStream``) with each connection it
  admits, within ``frame_timeout``, and tells a client that speaks plaintext so
  in a plaintext error frame before it closes; ``Peers`` wraps each connection
  it dials and verifies the server.
- ``Limits.tokens`` (``auth.TokenFile``) makes a ``FrameServer`` check every
  request, before any handler runs, against the token its connection presented
  (an AUTH request, answered here; ``Peers`` sends ``Limits.token`` so first on
  each connection it dials): a refused request is answered ``unauthorized`` or
  ``forbidden`` and changes nothing. The check reads the table as it is at each
  request, so a reload applies to connections already open. A token with rates
  (``messages_per_s``, ``bytes_per_s``) then has its SEND and SCHEDULE batches
  taken from its buckets (``ratelimit.RateLimiter``, fed trio's monotonic clock):
  one over its rate is answered ``rate_limited`` with ``retry_after_ms``.
- A connection has at most ``ConnectionLimits.max_in_flight`` requests in
  flight; at the cap the server stops reading it until one is answered
  (back-pressure, not a refusal). ``ServerStatistics.refused_by_reason`` counts
  every error answer by its code.
"""

from __future__ import annotations

import itertools
import logging
import math
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field

import trio

from delaymq.net.accepting import RESERVED_FDS, Acceptor, ReservedFds, first_byte, peer_host_and_fd, peer_name
from delaymq.net.addresses import format_address
from delaymq.net.admission import (
    Admitted,
    ConnectionAdmission,
    Refusal,
    RefusalLog,
    open_file_limit,
)
from delaymq.net.answering import RequestAnswerer
from delaymq.net.connection import RECEIVE_SIZE, describe_broken
from delaymq.net.limits import DEFAULT_LIMITS, Limits
from delaymq.net.requests import (
    CONNECTION_REQUEST_ID,
    UNAUTHENTICATED_COMMANDS,
    Handler,
)
from delaymq.net.tls import TLS_HANDSHAKE_RECORD, TLS_REQUIRED
from delaymq.protocol.commands import Command, command_name
from delaymq.protocol.errors import (
    LocalProtocolError,
    ProtocolError,
)
from delaymq.protocol.frames import (
    Frame,
    FrameDecoder,
    FrameKind,
    encode_frame,
    error_response,
)
from delaymq.protocol.limits import MAX_UNAUTHENTICATED_FRAME

log = logging.getLogger(__name__)

#: Each served connection's number, unique in the process (``Request.connection``).
_connection_numbers = itertools.count(1)


#: How long a refusal may take to write before the connection is closed without it.
REFUSAL_WRITE_TIMEOUT = 1.0


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
    #: Requests answered with an error, by its code (``unauthorized``, ``rate_limited``, ``limit``, ...).
    refused_by_reason: Mapping[str, int] = field(default_factory=dict)
    #: Times a connection reached ``max_in_flight`` and the server stopped reading it until an answer.
    in_flight_full: int = 0


class FrameServer:
    """Serves ``handlers`` (command code → handler) to every connection.

    ``limits.connections`` caps what clients' connections may hold (see
    ``ConnectionLimits``): past a cap a connection is answered with an
    ``unavailable`` error frame and closed, never left hanging.
    """

    def __init__(self, handlers: Mapping[int, Handler], *, limits: Limits = DEFAULT_LIMITS) -> None:
        self.limits = limits
        self.admission = ConnectionAdmission(limits.connections, max_frame=limits.max_frame, fd_limit=open_file_limit())
        self._tls = limits.tls.server_context() if limits.tls is not None else None
        self._refusal_log = RefusalLog()
        self._requests = 0
        self._dropped = 0
        self._closed_idle = 0
        self._closed_slow = 0
        self._in_flight_full = 0
        self.answerer = RequestAnswerer(handlers, tokens=limits.tokens, refusal_log=self._refusal_log)

    def statistics(self) -> ServerStatistics:
        admission = self.admission
        refused = admission.refused
        return ServerStatistics(
            connections_open=admission.open,
            connections_total=admission.admitted,
            requests=self._requests,
            errors_answered=self.answerer.errors_answered,
            connections_dropped=self._dropped,
            refused_at_connection_cap=refused["connections"],
            refused_at_address_cap=refused["connections_per_address"],
            refused_for_file_descriptors=refused["file_descriptors"],
            refused_for_buffered_bytes=refused["buffered_bytes"],
            closed_idle=self._closed_idle,
            closed_slow=self._closed_slow,
            buffered_bytes=admission.buffered,
            buffered_bytes_peak=admission.buffered_peak,
            refused_by_reason=dict(self.answerer.refused),
            in_flight_full=self._in_flight_full,
        )

    def error_answered(self, code: str) -> None:
        self.answerer.error_answered(code)

    async def serve(
        self, host: str = "127.0.0.1", port: int = 0, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Listen and serve until cancelled; ``nursery.start`` gets the bound address."""
        listeners = await trio.open_tcp_listeners(port, host=host)
        sockname = listeners[0].socket.getsockname()
        address = format_address(sockname[0], sockname[1])
        if self.limits.tls is not None and self._tls is not None:
            log.info("%s takes %s connections only", address, self.limits.tls.describe())
        reserve = ReservedFds(RESERVED_FDS)
        try:
            async with trio.open_nursery() as nursery:
                for listener in listeners:
                    nursery.start_soon(Acceptor(self, reserve).accept, listener, nursery)
                task_status.started(address)
        finally:
            reserve.close()

    async def serve_stream(self, stream: trio.abc.Stream) -> None:
        """Serve one connection until the peer leaves, idles, or its bytes stop making sense."""
        peer = peer_name(stream)
        host, fd = peer_host_and_fd(stream)
        admitted = self.admission.admit(host, fd)
        if isinstance(admitted, Refusal):
            self.log_refusal(admitted)
            await self.refuse(stream, admitted, write_timeout=REFUSAL_WRITE_TIMEOUT)
            return
        try:
            served: trio.abc.Stream = stream
            if self._tls is not None:
                secured = await self._handshake(stream, peer, self._tls)
                if secured is None:
                    return
                served = secured
            async with trio.open_nursery() as nursery:
                connection = _ServedConnection(self, served, peer, admitted, nursery)
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

    async def _handshake(self, stream: trio.abc.Stream, peer: str, context: ssl.SSLContext) -> trio.SSLStream | None:
        """The connection wrapped in TLS once its handshake is done; None (logged once): refused, closed.

        A client that sends a frame instead of a TLS handshake is a plaintext
        client: it is told so in a plaintext error frame (request 0, as a refusal
        at a cap), which it reads as the reason its connection was closed.
        """
        timeout = self.limits.connections.frame_timeout
        with trio.move_on_after(timeout):
            first = await first_byte(stream)
            if first is None:
                return None  # gone before a byte: a port probe
            if first >= 0 and first != TLS_HANDSHAKE_RECORD:
                log.warning("refused a plaintext connection from %s: this server takes TLS connections only", peer)
                error = ProtocolError(
                    "this server takes TLS connections only: give the client the CA of the servers' "
                    "certificates (--tls-ca)",
                    code=TLS_REQUIRED,
                    field="tls",
                )
                await self.refuse(stream, error, write_timeout=REFUSAL_WRITE_TIMEOUT)
                return None
            secured = trio.SSLStream(stream, context, server_side=True)
            try:
                await secured.do_handshake()
            except (trio.BrokenResourceError, trio.ClosedResourceError) as broken:
                log.warning("refused a connection from %s: TLS handshake failed: %s", peer, describe_broken(broken))
                return None
            return secured
        log.warning("refused a connection from %s: no TLS handshake within %g s", peer, timeout)
        return None

    async def refuse(self, stream: trio.abc.Stream, refusal: Refusal | ProtocolError, *, write_timeout: float) -> None:
        """Tell the client why (an error frame for request 0: the connection), then close."""
        try:
            error = refusal.error() if isinstance(refusal, Refusal) else refusal
            data = encode_frame(error_response((0, CONNECTION_REQUEST_ID), error), self.limits)
            with trio.move_on_after(write_timeout):
                await stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await trio.aclose_forcefully(stream)

    def log_refusal(self, refusal: Refusal) -> None:
        count = self._refusal_log.note(refusal.cap, trio.current_time())
        if count is not None:
            log.warning("refusing connections: %s (%d refused since the last such line)", refusal.message, count)

    def _log_slow(self, message: str) -> None:
        count = self._refusal_log.note("slow", trio.current_time())
        if count is not None:
            log.warning("closing slow connections: %s (%d closed since the last such line)", message, count)


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
        self._decoder = FrameDecoder(server.limits, serving=True)
        self._send_lock = trio.Lock()
        self._in_flight = trio.Semaphore(server.limits.connections.max_in_flight)
        self._handling = 0
        self._last_active = trio.current_time()
        self._frame_started = 0.0
        self._read_scope: trio.CancelScope | None = None
        #: The token this connection's AUTH presented (checked again at each request: a reload applies).
        self._token: str | None = None
        self._number = next(_connection_numbers)
        self._table_seen = server.limits.tokens.table if server.limits.tokens is not None else None
        self._shut_gate()

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
            self._server.error_answered(error.code)
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
        self._server.log_refusal(refusal)
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
            self._check_token_kept()  # before the frame is decoded: a dropped token gates it
            try:
                frame = self._decoder.next_frame()
            except ProtocolError as error:
                if error.fatal:
                    raise
                completed += 1
                self._server.error_answered(error.code)
                log.info("bad frame from %s: %s", self._peer, error)
                await self._send(error_response(error, error))
                continue
            if frame is None:
                return completed
            completed += 1
            self._server._requests += 1
            try:
                self._in_flight.acquire_nowait()  # no scheduling round per frame while slots are free
            except trio.WouldBlock:
                self._server._in_flight_full += 1
                await self._in_flight.acquire()  # backpressure: stop reading this peer
            self._handling += 1
            if frame.command == Command.AUTH and frame.kind == FrameKind.REQUEST:
                # Taken here, before the next frame is decoded: what follows it is read under
                # it. A refused AUTH leaves the connection with no token, gated again.
                answer, token = self._server.answerer.authenticate(frame, self._peer)
                self._token = token
                if token is None:
                    self._shut_gate()
                else:
                    self._decoder.open_gate()
                self._nursery.start_soon(self._handle, frame, None, answer)
            else:
                self._nursery.start_soon(self._handle, frame, self._token)

    def _shut_gate(self) -> None:
        if self._server.limits.tokens is not None:  # nothing but AUTH and PING, in small frames, until a token
            self._decoder.gate(
                max_frame=MAX_UNAUTHENTICATED_FRAME,
                commands=UNAUTHENTICATED_COMMANDS,
                reason="AUTH presents a token: no token yet, and this server requires one (--token or DELAYMQ_TOKEN)",
            )

    def _check_token_kept(self) -> None:
        """After a reload that dropped this connection's token, it is gated as one that never had one."""
        tokens = self._server.limits.tokens
        if tokens is None or self._token is None or tokens.table is self._table_seen:
            return
        self._table_seen = tokens.table
        if tokens.table.identify(self._token) is None:
            self._token = None
            self._shut_gate()

    async def _handle(self, frame: Frame, token: str | None, answer: Frame | None = None) -> None:
        try:
            if answer is None:
                answer = await self._server.answerer.answer(frame, self._peer, token, self._number)
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
            self._server.error_answered("internal")
            log.error("the answer to %s from %s cannot be sent: %s", command_name(frame.command), self._peer, error)
            internal = ProtocolError(f"internal error: the answer cannot be sent: {error}", code="internal")
            data = encode_frame(error_response(frame, internal), self._server.limits)
        lock = self._send_lock
        with trio.move_on_after(self._timeouts.frame_timeout) as scope:
            try:
                lock.acquire_nowait()  # no scheduling round per answer while nobody else writes
            except trio.WouldBlock:
                await lock.acquire()
            try:
                await self._stream.send_all(data)
            finally:
                lock.release()
        if scope.cancelled_caught:
            # A peer that does not read its answers holds their memory (and its
            # requests' slots) for ever; a half-written frame also breaks the stream.
            self._server._closed_slow += 1
            self._server._log_slow(
                f"an answer to {self._peer} could not be written within {self._timeouts.frame_timeout:g} s"
            )
            self._nursery.cancel_scope.cancel()
            raise trio.ClosedResourceError("the peer does not read its answers")
