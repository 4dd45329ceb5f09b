"""One connection to a peer, dialled by ``Peers``: requests on it run concurrently, matched to
their responses by request id; the errors a caller sees when a peer cannot answer."""

from __future__ import annotations

import itertools
import ssl
from typing import Any

import trio

from delaymq.net.limits import Limits
from delaymq.net.requests import CONNECTION_REQUEST_ID
from delaymq.net.tls import TLS_REQUIRED
from delaymq.protocol.commands import Command, command_name
from delaymq.protocol.errors import (
    PeerError,
    ProtocolError,
)
from delaymq.protocol.frames import (
    Frame,
    FrameDecoder,
    encode_frame,
    request,
    response_error,
)

RECEIVE_SIZE = 256 * 1024


class TransportError(Exception):
    """A request could not be completed: the peer is unreachable or too slow."""

    def __init__(self, message: str, *, address: str) -> None:
        super().__init__(message)
        self.address = address


class PeerUnavailable(TransportError):
    """Connecting failed, the connection broke, or the peer is in its backoff."""


class RequestTimeout(TransportError):
    """No response within the request's timeout."""


def describe_broken(error: BaseException) -> str:
    """What broke a stream: trio's ``BrokenResourceError`` around an ``ssl.SSLError`` says nothing itself."""
    cause = error.__cause__ or error.__context__
    if isinstance(cause, ssl.SSLCertVerificationError):
        return f"TLS: certificate verify failed: {cause.verify_message}"
    if isinstance(cause, ssl.SSLError):  # "[SSL: CODE] what happened (_ssl.c:2580)": the code and the words
        text = str(cause.args[1]) if len(cause.args) > 1 else str(cause)
        return f"TLS: {text.split(' (_ssl.c:')[0]}"
    return str(error) or str(cause or "") or type(error).__name__


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


async def authenticate(connection: Connection, token: str, *, timeout: float) -> None:
    """Present ``token`` on a new connection (AUTH); a refusal is a ``PeerError`` naming the server."""
    try:
        await connection.call(Command.AUTH, {"token": token}, timeout=timeout)
    except PeerError as error:
        raise PeerError(
            f"{connection.address} refused this client's token: {error}", code=error.code, field=error.field
        ) from None


async def close_connection(connection: Connection | None) -> None:
    if connection is not None:
        connection.closed = True
        await trio.aclose_forcefully(connection._stream)


async def tls_handshake(stream: trio.abc.Stream, context: ssl.SSLContext, host: str, address: str) -> trio.SSLStream:
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
