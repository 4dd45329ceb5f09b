"""The accept loop of a listener: each connection served in its own task, and what is done when
the process has no file descriptor left to accept one with (a few held in reserve are let go, so
a waiting client is told ``unavailable`` instead of waiting unanswered)."""

from __future__ import annotations

import errno
import logging
import os
import socket
from typing import Protocol

import trio

from delaymq.net.addresses import format_address
from delaymq.net.admission import (
    ConnectionAdmission,
    Refusal,
)

log = logging.getLogger("delaymq.net.server")

ACCEPT_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
#: Descriptors a serving listener holds open on /dev/null, let go when accept finds none free.
RESERVED_FDS = 2
#: How long the accept loop waits when accept fails and no reserved descriptor helps.
ACCEPT_RETRY_DELAY = 0.1


class Refuser(Protocol):
    """What the accept loop needs of the server it accepts for."""

    admission: ConnectionAdmission

    async def serve_stream(self, stream: trio.abc.Stream) -> None: ...

    def log_refusal(self, refusal: Refusal) -> None: ...

    async def refuse(self, stream: trio.abc.Stream, refusal: Refusal, *, write_timeout: float) -> None: ...


class Acceptor:
    """Accepts on ``listener`` for ``server`` until cancelled."""

    def __init__(self, server: Refuser, reserve: ReservedFds) -> None:
        self._server = server
        self._reserve = reserve

    async def accept(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        """Accept until cancelled; each connection is served (or refused) in its own task."""
        async with listener:
            while True:
                try:
                    stream = await listener.accept()
                except OSError as error:
                    if error.errno not in ACCEPT_CAPACITY_ERRNOS:
                        raise
                    await self._accept_without_descriptors(listener, nursery, error)
                    continue
                nursery.start_soon(self._server.serve_stream, stream)

    async def _accept_without_descriptors(
        self, listener: trio.SocketListener, nursery: trio.Nursery, error: OSError
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
            self._server.log_refusal(Refusal("memory", 0, f"accept failed with {name}; retrying"))
            await trio.sleep(ACCEPT_RETRY_DELAY)
            return
        await trio.lowlevel.wait_readable(listener.socket)
        try:
            stream = await listener.accept()  # descriptors may have come free meanwhile
        except OSError as again:
            if again.errno not in ACCEPT_CAPACITY_ERRNOS:
                raise
        else:
            nursery.start_soon(self._server.serve_stream, stream)
            return
        refusal = Refusal(
            "file_descriptors",
            self._server.admission.fd_limit or 0,
            f"the server process is out of file descriptors (accept: {name}); try again later",
        )
        if not self._reserve.release():
            self._server.log_refusal(refusal)
            await trio.sleep(ACCEPT_RETRY_DELAY)
            self._reserve.refill()
            return
        try:
            stream = await listener.accept()
        except OSError as again:
            self._reserve.refill()
            if again.errno not in ACCEPT_CAPACITY_ERRNOS:
                raise
            await trio.sleep(ACCEPT_RETRY_DELAY)
            return
        self._server.admission.refused["file_descriptors"] += 1
        self._server.log_refusal(refusal)
        await self._server.refuse(stream, refusal, write_timeout=0.05)  # closes it: the reserve can be taken again
        self._reserve.refill()


def peer_name(stream: trio.abc.Stream) -> str:
    try:
        host, port = stream.socket.getpeername()[:2]  # type: ignore[attr-defined]
        return format_address(host, port)
    except (AttributeError, OSError):
        return "?"


async def first_byte(stream: trio.abc.Stream) -> int | None:
    """The first byte the client sent, left unread; None: it closed first; -1: cannot peek (not a socket)."""
    sock = getattr(stream, "socket", None)
    if sock is None:
        return -1
    try:
        data = await sock.recv(1, socket.MSG_PEEK)
    except OSError:
        return None
    return data[0] if data else None


def peer_host_and_fd(stream: trio.abc.Stream) -> tuple[str | None, int | None]:
    """The client's host and the connection's descriptor number; None for an in-memory stream."""
    try:
        sock = stream.socket  # type: ignore[attr-defined]
        return str(sock.getpeername()[0]), sock.fileno()
    except (AttributeError, OSError):
        return None, None


class ReservedFds:
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
