"""``open_peers``: one reused connection per peer address, each request timed out, a connection
whose peer went silent given up (``ProbeSettings``), and after a failed connect a growing
backoff before that peer is dialled again."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import trio

from delaymq.net.addresses import parse_address
from delaymq.net.connection import (
    Connection,
    PeerUnavailable,
    ProbeSettings,
    RequestTimeout,
    TransportError,
    authenticate,
    close_connection,
    tls_handshake,
)
from delaymq.net.limits import DEFAULT_LIMITS, Limits
from delaymq.protocol.backoff import Backoff, BackoffRun, RandomSource
from delaymq.protocol.commands import command_name
from delaymq.protocol.errors import (
    PeerError,
    sole,
)
from delaymq.protocol.frames import (
    Frame,
)


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
    """One reused connection per peer address, redialled with backoff.

    ``probe_after`` and ``probe_timeout`` (seconds; ``probe_after=None``: never) are
    when a connection with requests outstanding and nothing received is PINGed,
    and when it is given up (``ProbeSettings``); the next call dials afresh.
    While a connect hangs, another attempt starts every ``redial_every`` seconds
    (None: one attempt), all within ``connect_timeout``; the first through wins.
    """

    def __init__(
        self,
        nursery: trio.Nursery,
        *,
        limits: Limits = DEFAULT_LIMITS,
        connect_timeout: float = 5.0,
        request_timeout: float = 10.0,
        backoff_initial: float = 0.1,
        backoff_max: float = 5.0,
        probe_after: float | None = 1.0,
        probe_timeout: float = 1.0,
        redial_every: float | None = 1.0,
    ) -> None:
        if redial_every is not None and not 0 < redial_every < float("inf"):
            raise ValueError(f"redial_every must be a number of seconds above 0 or None, not {redial_every!r}")
        self._nursery = nursery
        self._limits = limits
        self._probe = ProbeSettings(probe_after, probe_timeout) if probe_after is not None else None
        self._redial_every = redial_every
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
                stream = await self._open_tcp(host, port)
                if self._tls is not None:
                    stream = await tls_handshake(stream, self._tls, host, address)
                dialed = Connection(address, stream, limits=self._limits, probe=self._probe)
                self._nursery.start_soon(self._read, dialed)
                if self._limits.token is not None:
                    await authenticate(dialed, self._limits.token, timeout=connect_timeout)
        except PeerError:  # the token refused (or a TLS listener to this plaintext client): no retry changes it
            self._failures += 1
            await close_connection(dialed)
            raise
        except PeerUnavailable:  # the TLS handshake failed: the server is not the one trusted, or refused us
            self._failures += 1
            self._backoff.failed(address, trio.current_time())
            await close_connection(dialed)
            raise
        except (OSError, trio.TooSlowError, ValueError, TransportError) as error:
            self._failures += 1
            self._backoff.failed(address, trio.current_time())
            await close_connection(dialed)
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

    async def _open_tcp(self, host: str, port: int) -> trio.abc.Stream:
        """A TCP connection to ``host:port``, a fresh attempt every ``redial_every`` s while none gets through.

        A SYN lost in a network cut is sent again only after 1 s, 2 s, 4 s...: a
        connect begun during the cut may get through seconds after the link is back.
        The first attempt to connect or fail decides; the others are cancelled.
        """
        if self._redial_every is None:
            return await trio.open_tcp_stream(host, port)
        outcomes: list[trio.abc.Stream | OSError | ValueError] = []

        async def attempt(nursery: trio.Nursery) -> None:
            try:
                outcomes.append(await trio.open_tcp_stream(host, port))
            except (OSError, ValueError) as error:
                outcomes.append(error)
            nursery.cancel_scope.cancel()

        try:
            async with trio.open_nursery() as nursery:
                while True:
                    nursery.start_soon(attempt, nursery)
                    await trio.sleep(self._redial_every)
        except BaseException:  # cancelled (its connect timeout): no connection is kept
            await _close_streams(outcomes)
            raise
        first, *others = outcomes
        await _close_streams(others)
        if isinstance(first, OSError | ValueError):
            raise first
        return first

    async def _read(self, connection: Connection) -> None:
        """Read ``connection``'s responses; once it ends, it leaves the table (the next call dials afresh)."""
        try:
            await connection.read_responses()
        finally:
            if self._connections.get(connection.address) is connection:
                del self._connections[connection.address]

    async def aclose(self) -> None:
        for connection in list(self._connections.values()):  # each leaves the table as its reader ends
            await trio.aclose_forcefully(connection._stream)
        self._connections.clear()


async def _close_streams(outcomes: list[trio.abc.Stream | OSError | ValueError]) -> None:
    for outcome in outcomes:
        if isinstance(outcome, trio.abc.Stream):
            await trio.aclose_forcefully(outcome)


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
