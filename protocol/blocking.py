"""The blocking-socket twin of ``transport.Peers``, for clients in plain code.

Same frames, same errors, same one-connection-per-peer reuse and connect
backoff; a lock per connection keeps one request in flight at a time, which is
what a blocking caller does anyway.
"""

from __future__ import annotations

import itertools
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from delaymq.protocol.commands import command_name
from delaymq.protocol.errors import ProtocolError
from delaymq.protocol.frames import Frame, FrameDecoder, encode_frame, request, response_error
from delaymq.protocol.limits import DEFAULT_LIMITS, Limits
from delaymq.protocol.transport import RECEIVE_SIZE, ConnectBackoff, PeerUnavailable, RequestTimeout, parse_address


class BlockingCaller(Protocol):
    """What a client of one peer at a time needs of ``BlockingPeers``: a request to an address."""

    def call(
        self,
        address: str,
        command: int,
        metadata: dict[str, Any] | None = ...,
        body: bytes = ...,
        *,
        timeout: float | None = ...,
    ) -> Frame: ...


@dataclass
class _Link:
    sock: socket.socket
    decoder: FrameDecoder
    lock: threading.Lock = field(default_factory=threading.Lock)


class BlockingPeers:
    """One reused blocking connection per peer address."""

    def __init__(
        self,
        *,
        limits: Limits = DEFAULT_LIMITS,
        connect_timeout: float = 5.0,
        request_timeout: float = 10.0,
        backoff_initial: float = 0.1,
        backoff_max: float = 5.0,
    ) -> None:
        self._limits = limits
        self._connect_timeout = connect_timeout
        self.request_timeout = request_timeout
        self._backoff = ConnectBackoff(backoff_initial, backoff_max)
        self._links: dict[str, _Link] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def call(
        self,
        address: str,
        command: int,
        metadata: dict[str, Any] | None = None,
        body: bytes = b"",
        *,
        timeout: float | None = None,
    ) -> Frame:
        timeout = self.request_timeout if timeout is None else timeout
        link = self._link(address)
        request_id = next(self._ids) & 0xFFFF_FFFF
        data = encode_frame(request(command, request_id, metadata, body), self._limits)
        deadline = time.monotonic() + timeout
        with link.lock:
            try:
                answer = self._exchange(link, data, request_id, deadline)
            except socket.timeout:
                self._drop(address, link)  # a late answer would desynchronise the next call
                raise RequestTimeout(
                    f"{command_name(command)} to {address} got no answer within {timeout:g} s", address=address
                ) from None
            except (OSError, ProtocolError) as error:  # the stream is gone or untrustworthy
                self._drop(address, link)
                raise PeerUnavailable(f"connection to {address} lost: {error}", address=address) from error
        error = response_error(answer)
        if error is not None:
            raise error
        return answer

    @staticmethod
    def _exchange(link: _Link, data: bytes, request_id: int, deadline: float) -> Frame:
        link.sock.settimeout(max(0.0, deadline - time.monotonic()))
        link.sock.sendall(data)
        while True:
            for frame in link.decoder:
                if frame.request_id == request_id:
                    return frame
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise socket.timeout()
            link.sock.settimeout(remaining)
            chunk = link.sock.recv(RECEIVE_SIZE)
            if not chunk:
                raise ConnectionResetError("the peer closed the connection")
            link.decoder.feed(chunk)

    def _link(self, address: str) -> _Link:
        with self._lock:
            link = self._links.get(address)
            if link is not None:
                return link
            now = time.monotonic()
            self._backoff.check(address, now)
            try:
                host, port = parse_address(address)
                sock = socket.create_connection((host, port), timeout=self._connect_timeout)
            except (OSError, ValueError) as error:
                self._backoff.failed(address, now)
                raise PeerUnavailable(f"cannot connect to {address}: {error}", address=address) from error
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._backoff.connected(address)
            link = self._links[address] = _Link(sock, FrameDecoder(self._limits))
            return link

    def _drop(self, address: str, link: _Link) -> None:
        with self._lock:
            if self._links.get(address) is link:
                del self._links[address]
        link.sock.close()

    def close(self) -> None:
        with self._lock:
            links, self._links = self._links, {}
        for link in links.values():
            link.sock.close()

    def __enter__(self) -> BlockingPeers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["BlockingCaller", "BlockingPeers"]
