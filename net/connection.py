"""One connection to a peer, dialled by ``Peers``: requests on it run concurrently, matched to
their responses by request id; a peer gone silent is probed with PING and given up
(``SilenceProbe``); the errors a caller sees when a peer cannot answer."""

from __future__ import annotations

import enum
import itertools
import math
import ssl
from dataclasses import dataclass
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
#: A frame is written in pieces of this size: a piece written after the first shows the peer
#: taking bytes, so a large request on a slow link is not mistaken for a silent peer.
WRITE_PIECE = 64 * 1024


class TransportError(Exception):
    """A request could not be completed: the peer is unreachable or too slow."""

    def __init__(self, message: str, *, address: str) -> None:
        super().__init__(message)
        self.address = address


class PeerUnavailable(TransportError):
    """Connecting failed, the connection broke, or the peer is in its backoff."""


class RequestTimeout(TransportError):
    """No response within the request's timeout."""


class PeerSilent(PeerUnavailable):
    """The peer sent nothing, not even an answer to a PING: the connection was given up (retryable)."""


@dataclass(frozen=True, slots=True)
class ProbeSettings:
    """When a connection with requests outstanding is probed, and when its silence ends it.

    After ``after`` seconds with nothing received while a request is outstanding a
    PING goes out; if nothing at all is received within ``timeout`` seconds more,
    every outstanding request fails with ``PeerSilent`` and the connection closes.
    Any bytes count, so a peer answering PINGs keeps a slow request alive.
    """

    after: float = 1.0
    timeout: float = 1.0

    def __post_init__(self) -> None:
        for name in ("after", "timeout"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value < math.inf:
                raise ValueError(f"probe {name} must be a number of seconds above 0, not {value!r}")


class ProbeStep(enum.Enum):
    IDLE = "idle"  # no request outstanding: nothing to watch
    WAIT = "wait"  # look again at the time given
    PING = "ping"  # silent too long: send a PING, look again at the time given
    DEAD = "dead"  # nothing came back within the probe's timeout


class SilenceProbe:
    """Sans-IO: when a connection's silence calls for a PING, and when it means the peer is gone.

    Fed trio's clock in seconds: ``heard`` when bytes arrive (or a large frame's
    write moves on), ``busy`` when a request goes out on an idle connection
    (silence while idle proves nothing), and asked ``step`` for what to do next.
    """

    __slots__ = ("settings", "_quiet_since", "_pinged_at")

    def __init__(self, settings: ProbeSettings, now: float) -> None:
        self.settings = settings
        self._quiet_since = now
        self._pinged_at: float | None = None

    def heard(self, now: float) -> None:
        self._quiet_since = now

    def busy(self, now: float) -> None:
        self._quiet_since = now
        self._pinged_at = None

    def step(self, now: float, outstanding: int, cap: int) -> tuple[ProbeStep, float]:
        """What to do at ``now`` with ``outstanding`` requests, ``cap`` the most a server reads at once."""
        if outstanding == 0:
            self._pinged_at = None
            return ProbeStep.IDLE, math.inf
        if outstanding >= cap:  # the server reads no more of us until it answers one: silence proves nothing
            self.busy(now)
            return ProbeStep.WAIT, now + self.settings.after
        pinged = self._pinged_at
        if pinged is not None:
            if self._quiet_since < pinged:
                if now >= pinged + self.settings.timeout:
                    return ProbeStep.DEAD, now
                return ProbeStep.WAIT, pinged + self.settings.timeout
            self._pinged_at = None  # heard since the PING: alive
        due = self._quiet_since + self.settings.after
        if now < due:
            return ProbeStep.WAIT, due
        self._pinged_at = now
        return ProbeStep.PING, now + self.settings.timeout


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
    """One connection to a peer; requests on it run concurrently.

    With ``probe`` settings, a connection whose peer goes silent while requests
    are outstanding is probed with PING and given up (``SilenceProbe``), so its
    callers retry on a fresh one instead of waiting out TCP's retransmissions.
    """

    def __init__(
        self, address: str, stream: trio.abc.Stream, *, limits: Limits, probe: ProbeSettings | None = None
    ) -> None:
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
        self._probe = SilenceProbe(probe, trio.current_time()) if probe is not None else None
        self._busy = trio.Event()  # set when a request goes out on an idle connection
        self._pinging = False  # a PING waits to be written
        self._silence: PeerSilent | None = None  # why the probe gave the connection up

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
        if not self._waiting and self._probe is not None:
            self._probe.busy(trio.current_time())
            self._busy.set()
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
        if isinstance(answer, PeerSilent):  # a fresh one per request, as for a refusal
            raise PeerSilent(str(answer), address=self.address)
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
                    await self._write(data)
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
            if self._silence is not None:  # closed by the probe while this frame waited to be written
                raise PeerSilent(str(self._silence), address=self.address) from error
            raise self._lost(error) from error

    async def _write(self, data: bytes) -> None:
        """Write one frame; each piece after the first that the stream takes shows the peer alive."""
        if len(data) <= WRITE_PIECE:
            await self._stream.send_all(data)
            return
        view = memoryview(data)
        for start in range(0, len(view), WRITE_PIECE):
            await self._stream.send_all(view[start : start + WRITE_PIECE])
            if start and self._probe is not None:
                self._probe.heard(trio.current_time())

    async def read_responses(self) -> None:
        """Route each response to its caller until the stream ends (or the probe gives the peer up)."""
        reason: BaseException | None = None
        try:
            async with trio.open_nursery() as nursery:
                if self._probe is not None:
                    nursery.start_soon(self._watch, self._probe, nursery)
                reason = await self._read()
                nursery.cancel_scope.cancel()
        finally:
            self.closed = True
            closed = PeerUnavailable(f"{self.address} closed the connection", address=self.address)
            reason = self.refusal or self._silence or reason or closed
            for waiter in list(self._waiting.values()):
                try:
                    waiter.send_nowait(reason)
                except trio.WouldBlock:
                    pass
            await trio.aclose_forcefully(self._stream)

    async def _read(self) -> BaseException | None:
        """Hand each response to its caller; what ended the stream (None: the peer closed it)."""
        decoder = FrameDecoder(self._limits)
        try:
            while True:
                data = await self._stream.receive_some(RECEIVE_SIZE)
                if not data:
                    return None
                if self._probe is not None:
                    self._probe.heard(trio.current_time())
                decoder.feed(data)
                for frame in decoder:
                    self._answered = True
                    if frame.request_id == CONNECTION_REQUEST_ID:
                        self._refused(frame)
                        continue
                    waiter = self._waiting.get(frame.request_id)
                    if waiter is not None:  # a PING's answer has none: it only had to arrive
                        waiter.send_nowait(frame)
        except (trio.BrokenResourceError, trio.ClosedResourceError, ProtocolError) as error:
            return error

    async def _watch(self, probe: SilenceProbe, nursery: trio.Nursery) -> None:
        """PING a peer silent while requests are outstanding; one that stays silent ends the connection."""
        # The server's in-flight cap, taken as this side's: past it the server stops reading us.
        cap = self._limits.connections.max_in_flight
        while True:
            step, at = probe.step(trio.current_time(), len(self._waiting), cap)
            if step is ProbeStep.IDLE:
                self._busy = trio.Event()
                if not self._waiting:
                    await self._busy.wait()
                continue
            if step is ProbeStep.DEAD:
                silent = probe.settings.after + probe.settings.timeout
                self._silence = PeerSilent(
                    f"{self.address} sent nothing for {silent:g} s, not even an answer to a PING: connection given up",
                    address=self.address,
                )
                nursery.cancel_scope.cancel()
                return
            if step is ProbeStep.PING and not self._pinging:
                self._pinging = True
                nursery.start_soon(self._ping)
            await trio.sleep_until(at)

    async def _ping(self) -> None:
        """Write a PING (it may wait behind a frame being written); its answer only has to arrive."""
        request_id = next(self._ids) % 0xFFFF_FFFF + 1
        try:
            await self._send(encode_frame(request(Command.PING, request_id), self._limits))
        except (TransportError, PeerError):
            pass  # the connection broke or was refused: the reader ends it
        finally:
            self._pinging = False

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
