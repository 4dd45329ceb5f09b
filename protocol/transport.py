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

import errno
import itertools
import logging
import math
import os
import socket
import ssl
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from delaymq.protocol.auth import (
    GROUP_COMMANDS,
    SUBJECT_COMMANDS,
    UNAUTHORIZED,
    AuthRefusal,
    Identity,
    Scope,
    TokenFile,
    TokenTable,
)
from delaymq.protocol.backoff import Backoff, BackoffRun, RandomSource
from delaymq.protocol.commands import Command, command_name
from delaymq.protocol.connections import (
    Admitted,
    ConnectionAdmission,
    Refusal,
    RefusalLog,
    open_file_limit,
)
from delaymq.protocol.envelope import EnvelopeError, RecordKind, iter_spans
from delaymq.protocol.errors import (
    LocalProtocolError,
    PeerError,
    ProtocolError,
    RemoteProtocolError,
    sole,
)
from delaymq.protocol.fencing import FENCE_FIELD
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
from delaymq.protocol.limits import DEFAULT_LIMITS, MAX_UNAUTHENTICATED_FRAME, Limits
from delaymq.protocol.ratelimit import RateLimiter
from delaymq.protocol.records import RECORD_HEADER_SIZE, record_subject
from delaymq.protocol.tls import TLS_HANDSHAKE_RECORD, TLS_REQUIRED

log = logging.getLogger(__name__)

#: What a handler returns: response metadata, or (metadata, body).
Reply = dict[str, Any] | tuple[dict[str, Any], bytes] | None
Handler = Callable[["Request"], Awaitable[Reply]]

RECEIVE_SIZE = 256 * 1024
#: Commands whose batches count against a token's message and byte rates (every request counts
#: against ``requests_per_s``).
RATED_COMMANDS = frozenset({Command.SEND, Command.SCHEDULE})
#: What a connection may send before its AUTH is accepted, on a server with a tokens file.
UNAUTHENTICATED_COMMANDS = frozenset({Command.AUTH, Command.PING})
#: The request id of an error frame about the connection itself (a refusal), not a request.
CONNECTION_REQUEST_ID = 0
#: Each served connection's number, unique in the process (``Request.connection``).
_connection_numbers = itertools.count(1)


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
    """One request as a handler sees it; ``identity`` is who its token is (None: no tokens file)."""

    frame: Frame
    peer: str
    identity: Identity | None = None
    #: The connection it came on: a handler may bind state to it (a registration).
    connection: int = 0

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
        self.handlers = dict(handlers)
        self.limits = limits
        self.admission = ConnectionAdmission(limits.connections, max_frame=limits.max_frame, fd_limit=open_file_limit())
        self._tls = limits.tls.server_context() if limits.tls is not None else None
        self._refusal_log = RefusalLog()
        self._requests = 0
        self._errors = 0
        self._dropped = 0
        self._closed_idle = 0
        self._closed_slow = 0
        self._refused: Counter[str] = Counter()
        self._in_flight_full = 0
        self._rates = RateLimiter()
        self._rated_table: TokenTable | None = None  # the token table the rate limiter last saw

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
            refused_by_reason=dict(self._refused),
            in_flight_full=self._in_flight_full,
        )

    def _error_answered(self, code: str) -> None:
        self._errors += 1
        self._refused[code] += 1

    async def serve(
        self, host: str = "127.0.0.1", port: int = 0, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Listen and serve until cancelled; ``nursery.start`` gets the bound address."""
        listeners = await trio.open_tcp_listeners(port, host=host)
        sockname = listeners[0].socket.getsockname()
        address = format_address(sockname[0], sockname[1])
        if self.limits.tls is not None and self._tls is not None:
            log.info("%s takes %s connections only", address, self.limits.tls.describe())
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
            first = await _first_byte(stream)
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
                await self._refuse(stream, error, write_timeout=REFUSAL_WRITE_TIMEOUT)
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

    async def _refuse(self, stream: trio.abc.Stream, refusal: Refusal | ProtocolError, *, write_timeout: float) -> None:
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

    def _log_refusal(self, refusal: Refusal) -> None:
        count = self._refusal_log.note(refusal.cap, trio.current_time())
        if count is not None:
            log.warning("refusing connections: %s (%d refused since the last such line)", refusal.message, count)

    def _log_slow(self, message: str) -> None:
        count = self._refusal_log.note("slow", trio.current_time())
        if count is not None:
            log.warning("closing slow connections: %s (%d closed since the last such line)", message, count)

    def authenticate(self, frame: Frame, peer: str) -> tuple[Frame, str | None]:
        """Answer an AUTH request: the answer, and the token the connection is to remember (None: refused)."""
        token = frame.metadata.get("token") if isinstance(frame.metadata, dict) else None
        if not isinstance(token, str) or not token:
            error = RemoteProtocolError(
                "AUTH: field 'token' must be a non-empty string", code="bad_request", field="token"
            )
            self._error_answered("bad_request")
            return error_response(frame, error), None
        tokens = self.limits.tokens
        if tokens is None:
            return response_to(frame, {"name": None}), token  # no tokens file: every request is served
        identity = tokens.table.identify(token)
        if identity is None:
            self._error_answered(UNAUTHORIZED)
            count = self._refusal_log.note("AUTH:unauthorized", trio.current_time())
            if count is not None:
                log.warning(
                    "refused a token from %s: unknown (%d such refusal(s) since the last such line)", peer, count
                )
            refusal = AuthRefusal(
                UNAUTHORIZED, "AUTH: unknown token: this server's tokens file does not hold it", "token"
            )
            return error_response(frame, refusal.error()), None
        return response_to(frame, {"name": identity.name}), token

    def _authorize(self, tokens: TokenFile, frame: Frame, token: str | None) -> tuple[Identity, dict[str, int] | None]:
        """The identity the request acts as, and what it took from its rates (None: nothing);
        ``RemoteProtocolError`` when the token may not send it, ``ProtocolError`` (``rate_limited``, or
        ``limit`` for a batch over a second's worth) past its rates.

        A known token's request is taken from ``requests_per_s`` first, before its scope is read (a
        SEND's records) or decided: a refused request is work too, and floods of them are rated."""
        table = tokens.table
        identity = table.identify(token)
        if identity is not None and "requests_per_s" in identity.rates:
            self._take_rates(table, identity, frame, {"requests_per_s": 1})
        checked = table.check(token, frame.command, request_scope(frame))
        if isinstance(checked, AuthRefusal):
            raise checked.error()
        if not checked.rates.keys() - {"requests_per_s"} or frame.command not in RATED_COMMANDS:
            return checked, None
        amounts = {"messages_per_s": batch_messages(frame), "bytes_per_s": len(frame.body)}
        self._take_rates(table, checked, frame, amounts)
        return checked, amounts

    def _take_rates(self, table: TokenTable, identity: Identity, frame: Frame, amounts: dict[str, int]) -> None:
        """Take ``amounts`` from the token's buckets of those rates, or refuse the request (nothing taken)."""
        if table is not self._rated_table:  # reloaded: a token removed takes its buckets with it
            self._rates.forget(table.names())
            self._rated_table = table
        rates = {name: rate for name, rate in identity.rates.items() if name in amounts}
        now_ms = math.floor(trio.current_time() * 1000)
        refusal = self._rates.check(identity.name, rates, amounts, now_ms, command=command_name(frame.command))
        if refusal is not None:
            raise refusal.error()

    async def _answer(self, frame: Frame, peer: str, token: str | None = None, connection: int = 0) -> Frame | None:
        expects_answer = frame.kind == FrameKind.REQUEST
        if frame.kind == FrameKind.RESPONSE:
            error = RemoteProtocolError(
                f"a response frame ({command_name(frame.command)}) sent to a server",
                code="bad_frame",
                field="kind",
            )
            self._error_answered("bad_frame")
            return error_response(frame, error)
        handler = self.handlers.get(frame.command)
        tokens = self.limits.tokens
        identity: Identity | None = None
        taken: dict[str, int] | None = None
        try:
            if tokens is not None:  # before anything else: a refused request changes nothing
                identity, taken = self._authorize(tokens, frame, token)
            if handler is None:
                known = ", ".join(command_name(code) for code in sorted(self.handlers))
                raise RemoteProtocolError(
                    f"unknown command {command_name(frame.command)} (this server serves {known})",
                    code="bad_request",
                    field="command",
                )
            reply = await handler(Request(frame, peer, identity, connection))
        except ProtocolError as error:
            if taken is not None and identity is not None:  # a refused batch stores nothing: its messages
                # are not charged (the request itself counts against requests_per_s all the same)
                self._rates.give_back(identity.name, taken, math.floor(trio.current_time() * 1000))
            self._error_answered(error.code)
            # A flood of one refusal (a full disk refuses every SEND) is a line a minute with a count.
            count = self._refusal_log.note(f"{frame.command}:{error.code}", trio.current_time())
            if count is not None:
                log.info(
                    "refused %s from %s: %s (%d such refusal(s) since the last such line)",
                    command_name(frame.command), peer, error, count,
                )  # fmt: skip
            return error_response(frame, error) if expects_answer else None
        except Exception as error:  # a bug in a handler must not kill the server
            self._error_answered("internal")
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
            self._server._error_answered(error.code)
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
            self._check_token_kept()  # before the frame is decoded: a dropped token gates it
            try:
                frame = self._decoder.next_frame()
            except ProtocolError as error:
                if error.fatal:
                    raise
                completed += 1
                self._server._error_answered(error.code)
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
                answer, token = self._server.authenticate(frame, self._peer)
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
                answer = await self._server._answer(frame, self._peer, token, self._number)
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
            self._server._error_answered("internal")
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


def batch_messages(frame: Frame) -> int:
    """The message records in a SEND's or SCHEDULE's body (its subjects were read without error before)."""
    try:
        return sum(1 for span in iter_spans(frame.body) if span.kind == RecordKind.MESSAGE)
    except EnvelopeError as error:
        raise RemoteProtocolError(f"{command_name(frame.command)}: {error}", code="bad_record", field="body") from None


def request_scope(frame: Frame) -> Scope:
    """What a request acts on, for the token's patterns (``auth.Scope``).

    SEND and SCHEDULE: the subject of each message record of the body, and a
    SEND's fence (the scheduler group it speaks for); REGISTER: the kind and
    group it registers; consumer commands: their ``group``; the others: their
    metadata's ``subject`` (``subjects`` for CONSUMER_HEARTBEAT). A field of the
    wrong type is left out here for the handler to refuse; a body whose records
    do not check is refused here as the handler would refuse it (``bad_record``).
    """
    command = frame.command
    metadata = frame.metadata if isinstance(frame.metadata, dict) else {}
    group = metadata.get("group") if command in GROUP_COMMANDS else None
    group = group if isinstance(group, str) else None
    server = _server_scope(command, metadata)
    subjects = _request_subjects(frame, metadata) if command in SUBJECT_COMMANDS else ()
    return Scope(None if subjects is None else tuple(subjects), group, server)


def _server_scope(command: int, metadata: dict[str, Any]) -> tuple[str, str] | None:
    """The (kind, group) a REGISTER or a fenced SEND speaks as."""
    if command == Command.REGISTER:
        kind, group = metadata.get("kind"), metadata.get("group")
        return (kind, group) if isinstance(kind, str) and isinstance(group, str) else None
    fence = metadata.get(FENCE_FIELD) if command == Command.SEND else None
    if isinstance(fence, dict) and isinstance(fence.get("group"), str):
        return ("scheduler", fence["group"])
    if fence is not None:  # malformed: only a server may carry a fence at all
        return ("scheduler", "?")
    return None


def _request_subjects(frame: Frame, metadata: dict[str, Any]) -> list[str] | None:
    command = frame.command
    if command in (Command.SEND, Command.SCHEDULE):
        subjects: dict[str, None] = {}
        try:
            for span in iter_spans(frame.body):
                if span.kind == RecordKind.MESSAGE and span.end - span.start >= RECORD_HEADER_SIZE:
                    with memoryview(frame.body)[span.start : span.end] as record:
                        subjects[record_subject(record).decode(errors="replace")] = None
        except EnvelopeError as error:
            raise RemoteProtocolError(f"{command_name(command)}: {error}", code="bad_record", field="body") from None
        return list(subjects)
    if command == Command.CONSUMER_HEARTBEAT:
        listed = metadata.get("subjects")
        return [subject for subject in listed if isinstance(subject, str)] if isinstance(listed, list) else []
    subject = metadata.get("subject")
    if isinstance(subject, str):
        return [subject]
    if command in (Command.CANCEL, Command.MOVE, Command.QUERY):
        return None  # by ids (or malformed: the handler says so to a token that may name any subject)
    return []


def _peer_name(stream: trio.abc.Stream) -> str:
    try:
        host, port = stream.socket.getpeername()[:2]  # type: ignore[attr-defined]
        return format_address(host, port)
    except (AttributeError, OSError):
        return "?"


async def _first_byte(stream: trio.abc.Stream) -> int | None:
    """The first byte the client sent, left unread; None: it closed first; -1: cannot peek (not a socket)."""
    sock = getattr(stream, "socket", None)
    if sock is None:
        return -1
    try:
        data = await sock.recv(1, socket.MSG_PEEK)
    except OSError:
        return None
    return data[0] if data else None


def describe_broken(error: BaseException) -> str:
    """What broke a stream: trio's ``BrokenResourceError`` around an ``ssl.SSLError`` says nothing itself."""
    cause = error.__cause__ or error.__context__
    if isinstance(cause, ssl.SSLCertVerificationError):
        return f"TLS: certificate verify failed: {cause.verify_message}"
    if isinstance(cause, ssl.SSLError):  # "[SSL: CODE] what happened (_ssl.c:2580)": the code and the words
        text = str(cause.args[1]) if len(cause.args) > 1 else str(cause)
        return f"TLS: {text.split(' (_ssl.c:')[0]}"
    return str(error) or str(cause or "") or type(error).__name__


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
        #: Set when the server said why it closes this connection: ``PeerUnavailable`` at a cap, a
        #: ``PeerError`` (``tls_required``) when this client speaks plaintext to a TLS listener.
        self.refusal: PeerUnavailable | PeerError | None = None
        self._answered = False  # a frame came back: the server took this connection

    def _lost(self, error: BaseException) -> PeerUnavailable:
        """Why requests failed when the connection broke; a TLS one closed at once may be for want of a certificate.

        Under TLS 1.3 a client's handshake is done before the server checks its
        certificate, and trio closes without the server's alert: all the client
        sees is the connection closing before any answer.
        """
        text = f"connection to {self.address} lost: {describe_broken(error)}"
        tls = self._limits.tls
        if not self._answered and isinstance(self._stream, trio.SSLStream) and tls is not None and tls.cert is None:
            text += (
                " before any answer (a server that requires client certificates closes so: "
                "give the client one with --tls-cert and --tls-key)"
            )
        return PeerUnavailable(text, address=self.address)

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
            raise self._refusal_error()
        if isinstance(answer, BaseException):
            raise self._lost(answer) from answer
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
                raise self._refusal_error() from error
            raise self._lost(error) from error

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
                    self._answered = True
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
        """An error frame about the connection (a server at a cap; a TLS listener to a plaintext client): why it closes."""
        error = response_error(frame)
        if error is None:
            return
        message = f"{self.address} refused the connection: {error}"
        if error.code == TLS_REQUIRED:  # about this client's configuration: no retry changes it
            self.refusal = PeerError(message, code=TLS_REQUIRED, field=error.field)
        else:
            self.refusal = PeerUnavailable(message, address=self.address)

    def _refusal_error(self) -> PeerUnavailable | PeerError:
        """A fresh exception for each request the refusal fails (one raised in many tasks would share a traceback)."""
        refusal = self.refusal
        assert refusal is not None
        if isinstance(refusal, PeerError):
            return PeerError(str(refusal), code=refusal.code, field=refusal.field)
        return PeerUnavailable(str(refusal), address=self.address)


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
        self._tls = limits.tls.client_context() if limits.tls is not None else None
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
        dialed: Connection | None = None
        try:
            host, port = parse_address(address)
            stream: trio.abc.Stream
            with trio.fail_after(connect_timeout):
                stream = await trio.open_tcp_stream(host, port)
                if self._tls is not None:
                    stream = await _tls_handshake(stream, self._tls, host, address)
                dialed = Connection(address, stream, limits=self._limits)
                self._nursery.start_soon(dialed.read_responses)
                if self._limits.token is not None:
                    await _authenticate(dialed, self._limits.token, timeout=connect_timeout)
        except PeerError:  # the token refused (or a TLS listener to this plaintext client): no retry changes it
            self._failures += 1
            await _close(dialed)
            raise
        except PeerUnavailable:  # the TLS handshake failed: the server is not the one trusted, or refused us
            self._failures += 1
            self._backoff.failed(address, trio.current_time())
            await _close(dialed)
            raise
        except (OSError, trio.TooSlowError, ValueError, TransportError) as error:
            self._failures += 1
            self._backoff.failed(address, trio.current_time())
            await _close(dialed)
            raise PeerUnavailable(
                f"cannot connect to {address}: {error or type(error).__name__}", address=address
            ) from error
        finally:
            del self._dialing[address]
            done.set()
        self._connects += 1
        self._backoff.connected(address)
        assert dialed is not None
        self._connections[address] = dialed
        return dialed

    async def aclose(self) -> None:
        for connection in self._connections.values():
            await trio.aclose_forcefully(connection._stream)
        self._connections.clear()


async def _authenticate(connection: Connection, token: str, *, timeout: float) -> None:
    """Present ``token`` on a new connection (AUTH); a refusal is a ``PeerError`` naming the server."""
    try:
        await connection.call(Command.AUTH, {"token": token}, timeout=timeout)
    except PeerError as error:
        raise PeerError(
            f"{connection.address} refused this client's token: {error}", code=error.code, field=error.field
        ) from None


async def _close(connection: Connection | None) -> None:
    if connection is not None:
        connection.closed = True
        await trio.aclose_forcefully(connection._stream)


async def _tls_handshake(stream: trio.abc.Stream, context: ssl.SSLContext, host: str, address: str) -> trio.SSLStream:
    """``stream`` wrapped in TLS, the server verified against the CA and ``host``; ``PeerUnavailable`` if not."""
    secured = trio.SSLStream(stream, context, server_hostname=host)
    try:
        await secured.do_handshake()
    except BaseException as error:
        await trio.aclose_forcefully(stream)
        if isinstance(error, trio.BrokenResourceError | trio.ClosedResourceError):
            raise PeerUnavailable(
                f"TLS handshake with {address} failed: {describe_broken(error)}", address=address
            ) from error
        raise
    return secured


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
