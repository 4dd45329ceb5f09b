"""An in-memory network for tests, in the spirit of ``trio.testing``.

``MemoryNetwork`` stands in for ``delaymq.net.peers.Peers``: it is an
``AsyncCaller``, so code that talks to its peers through ``AsyncCaller`` (route
clients, registration agents, servers calling other servers) can be tested
against real, in-process servers with no sockets. Servers are put on the network
by address with their ``serve_stream``; each call goes over a
pair of in-memory streams (``trio.testing``) and a real ``Connection``, one reused
connection per address, just as ``Peers`` keeps one per peer.

Code that dials with ``trio.open_tcp_stream`` itself (``Peers``, and the
clients over it) can be pointed at the same servers by patching
``trio.open_tcp_stream`` with ``MemoryNetwork.open_tcp_stream``. The blocking
clients run their trio loop in a thread of their own, so they need real sockets.

``silence(address)`` cuts the links to an address as a network partition does:
bytes stop both ways and nothing is closed or refused; after ``heal`` they flow
again, what was lost arriving at TCP's next retransmission.

This module is a public helper for tests; the servers and clients never use it.
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from trio.testing import MemoryReceiveStream, MemorySendStream, memory_stream_pump

from delaymq.net.connection import Connection, PeerUnavailable
from delaymq.net.limits import Limits
from delaymq.protocol.frames import Frame

__all__ = ["MemoryNetwork", "ServeStream"]

#: What a server puts on the network: its ``serve_stream``.
ServeStream = Callable[[trio.abc.Stream], Awaitable[None]]


#: TCP's first retransmission timeout (Linux's minimum); each one after a loss doubles it.
FIRST_RETRANSMIT = 0.2


class _Pipe:
    """One direction of a connection: bytes sent during a cut wait for TCP's next retransmission after it."""

    def __init__(self, cut: Callable[[], bool]) -> None:
        self._cut = cut
        self.send = MemorySendStream(send_all_hook=self._async_pump, close_hook=self.pump)
        self.receive = MemoryReceiveStream()
        self._lost_at: float | None = None  # when bytes were first sent into the cut

    def pump(self) -> None:
        if self._cut():
            if self._lost_at is None:
                self._lost_at = trio.current_time()
            return
        if self._lost_at is None:  # else the bytes go with the retransmission, in order
            memory_stream_pump(self.send, self.receive)  # the bytes, or the end
            memory_stream_pump(self.send, self.receive)  # the end after the bytes, if the sender closed

    async def _async_pump(self) -> None:
        self.pump()

    def next_retransmission(self, now: float) -> float | None:
        """When TCP sends what was lost again, its timeout doubling from ``FIRST_RETRANSMIT``; None: nothing lost."""
        if self._lost_at is None:
            return None
        wait = FIRST_RETRANSMIT
        at = self._lost_at + wait
        while at < now:
            wait *= 2
            at += wait
        return at

    def resume(self, nursery: trio.Nursery) -> None:
        """The link is back: what was lost during the cut arrives at its next retransmission."""
        at = self.next_retransmission(trio.current_time())
        if at is not None:
            nursery.start_soon(self._retransmit, at)

    async def _retransmit(self, at: float) -> None:
        await trio.sleep_until(at)
        self._lost_at = None
        try:
            self.pump()
        except trio.BrokenResourceError:
            pass  # the receiving end closed meanwhile: dropped


class MemoryNetwork:
    """``Peers.call`` over in-memory streams: address -> a server's ``serve_stream``.

    - ``serve(address, serve_stream)`` puts a server on the network at ``address``
      (or swaps the one there: its connection is dropped, the next call dials the
      new one) and brings the address back up if it was taken down.
    - ``take_down(address)`` makes the address unreachable but keeps its server:
      its connection breaks and new calls fail with ``PeerUnavailable`` until
      ``serve`` is called again (or the address is discarded from ``down``).
    - ``remove(address)`` takes the server off the network altogether.
    - ``silence(address)`` cuts its links silently: bytes on its connections stop
      both ways and nothing is closed. As with TCP, what was sent into the cut
      arrives after ``heal(address)`` only at its next retransmission (0.2 s after
      the loss, then 0.4 s, 0.8 s... later), and a dial hangs, its SYN sent again
      after 1 s, 2 s, 4 s..., until one is sent after the heal.
    - ``calls`` counts the calls made to each address, answered or not.

    Server tasks run in ``nursery``; a dropped connection cancels its server task.
    ``timeout`` is the request timeout used when a call gives none; ``limits`` are
    the frame limits of the client side of each connection.
    """

    def __init__(self, nursery: trio.Nursery, *, timeout: float = 10.0, limits: Limits | None = None) -> None:
        self._nursery = nursery
        self._timeout = timeout
        self._limits = limits if limits is not None else Limits()
        self._servers: dict[str, ServeStream] = {}
        self._connections: dict[str, tuple[Connection, trio.CancelScope]] = {}
        self.down: set[str] = set()
        self.silent: set[str] = set()
        #: Each connection's two directions, by address (held by its streams, so gone with them).
        self._pipes: dict[str, weakref.WeakSet[_Pipe]] = collections.defaultdict(weakref.WeakSet)
        self.calls: collections.Counter[str] = collections.Counter()

    def serve(self, address: str, serve_stream: ServeStream) -> None:
        self._servers[address] = serve_stream
        self.down.discard(address)
        self._drop(address)

    def take_down(self, address: str) -> None:
        self.down.add(address)
        self._drop(address)

    def silence(self, address: str) -> None:
        self.silent.add(address)

    def heal(self, address: str) -> None:
        self.silent.discard(address)
        for pipe in list(self._pipes[address]):
            pipe.resume(self._nursery)

    def _stream_pair(self, address: str) -> tuple[trio.abc.Stream, trio.abc.Stream]:
        """A connection to ``address``: its client end and its server end, both cut by ``silence``."""

        def cut() -> bool:
            return address in self.silent

        to_server, to_client = _Pipe(cut), _Pipe(cut)
        self._pipes[address].update((to_server, to_client))
        client_end = trio.StapledStream(to_server.send, to_client.receive)
        return client_end, trio.StapledStream(to_client.send, to_server.receive)

    def remove(self, address: str) -> None:
        self._servers.pop(address, None)
        self.down.discard(address)
        self._drop(address)

    def _drop(self, address: str) -> None:
        held = self._connections.pop(address, None)
        if held is not None:
            held[1].cancel()

    def _reachable(self, address: str) -> ServeStream | None:
        if address in self.down:
            return None
        return self._servers.get(address)

    async def call(
        self, address: str, command: int, metadata: dict[str, Any] | None = None, body: bytes = b"", *,
        timeout: float | None = None,
    ) -> Frame:  # fmt: skip
        """One request to the server at ``address``, as ``Peers.call`` makes it."""
        self.calls[address] += 1
        held = self._connections.get(address)
        if held is None or held[0].closed:
            serve_stream = self._reachable(address)
            if serve_stream is None:
                raise PeerUnavailable(f"cannot connect to {address}: it is down", address=address)
            client_end, server_end = self._stream_pair(address)
            connection = Connection(address, client_end, limits=self._limits)
            scope = trio.CancelScope()
            self._connections[address] = held = (connection, scope)
            self._nursery.start_soon(self._run, scope, serve_stream, server_end, connection)
        return await held[0].call(command, metadata, body, timeout=self._timeout if timeout is None else timeout)

    async def _run(
        self, scope: trio.CancelScope, serve_stream: ServeStream, stream: trio.abc.Stream, connection: Connection
    ) -> None:
        with scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(serve_stream, stream)
                await connection.read_responses()
                nursery.cancel_scope.cancel()
        connection.closed = True

    async def open_tcp_stream(self, host: str, port: int, **_options: Any) -> trio.abc.Stream:
        """A stand-in for ``trio.open_tcp_stream``: a fresh stream to the server at ``host:port``.

        Patch it in (``monkeypatch.setattr(trio, "open_tcp_stream", network.open_tcp_stream)``)
        for code that dials by itself; an address with no server, or taken down,
        refuses the connection with ``OSError`` as a closed port would.
        """
        await trio.lowlevel.checkpoint()
        address = f"{host}:{port}"
        syn_at, wait = trio.current_time(), 1.0
        while address in self.silent:  # the SYN is lost: TCP sends it again after 1 s, 2 s, 4 s...
            syn_at, wait = syn_at + wait, wait * 2
            await trio.sleep_until(syn_at)
        serve_stream = self._reachable(address)
        if serve_stream is None:
            raise OSError(f"connection to {address} refused (no in-process server there)")
        client_end, server_end = self._stream_pair(address)
        self._nursery.start_soon(serve_stream, server_end)
        return client_end
