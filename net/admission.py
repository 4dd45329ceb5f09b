"""Which connections a server takes, and how much of their half-sent frames it holds.

Sans-IO: ``ConnectionAdmission`` is told of each new connection (its client's
address and file descriptor number), of the bytes each one buffers and of each
close, and answers with a ``Refusal`` naming the cap a connection would break.
The trio transport (``transport.py``) applies the answers: it writes the refusal
as an ``unavailable`` error frame (a retryable code) and closes the connection.

``RefusalLog`` keeps a flood to one log line per minute per kind of refusal
instead of one line (or a traceback) per connection.
"""

from __future__ import annotations

import resource
from collections import Counter
from dataclasses import dataclass

from delaymq.net.limits import ConnectionLimits
from delaymq.protocol.errors import ProtocolError

#: The caps, as named in a ``Refusal`` and in the statistics.
CAPS = ("connections", "connections_per_address", "file_descriptors", "buffered_bytes")


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a connection is refused or closed: the cap (``CAPS``), its limit, a message."""

    cap: str
    limit: int
    message: str

    def error(self) -> ProtocolError:
        """The error to answer with: ``unavailable`` says "try again, or another group"."""
        return ProtocolError(self.message, code="unavailable", field=self.cap, limit=self.limit)


class Admitted:
    """One admitted connection: its client address and the bytes it buffers now."""

    __slots__ = ("address", "buffered")

    def __init__(self, address: str | None) -> None:
        self.address = address
        self.buffered = 0


def spare_fds_for(fd_limit: int) -> int:
    """The default ``spare_fds``: an eighth of the open-file limit, 64 to 1,024, at most half."""
    return min(min(1024, max(64, fd_limit // 8)), fd_limit // 2)


def open_file_limit() -> int | None:
    """This process's soft limit on open files (RLIMIT_NOFILE), None when unlimited."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


class ConnectionAdmission:
    """Counts open connections (in all and per address) and their buffered bytes against the caps.

    ``fd_limit`` is the process's open-file limit (None: no check). The kernel
    gives a new socket the lowest free descriptor number, so a connection whose
    descriptor is ``n`` proves ``n`` others are open: one at or above
    ``fd_limit - spare_fds`` is refused, which keeps descriptors free for the
    server's own files and outgoing connections whichever servers of the process
    hold the rest.
    """

    def __init__(self, limits: ConnectionLimits, *, max_frame: int, fd_limit: int | None) -> None:
        self.limits = limits
        self.max_buffered = limits.max_buffered if limits.max_buffered is not None else 2 * max_frame
        if fd_limit is None:
            self.fd_ceiling: int | None = None
        else:
            spare = limits.spare_fds if limits.spare_fds is not None else spare_fds_for(fd_limit)
            self.fd_ceiling = max(0, fd_limit - spare)
        self.fd_limit = fd_limit
        room = min(limits.max_connections, self.fd_ceiling if self.fd_ceiling is not None else limits.max_connections)
        #: One address may hold at most half of what the server can: a flood from it leaves room for others.
        self.max_per_address = max(1, min(limits.max_per_address, room // 2))
        self.open = 0
        self.admitted = 0
        self.per_address: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()
        self.buffered = 0
        self.buffered_peak = 0

    def admit(self, address: str | None, fd: int | None) -> Admitted | Refusal:
        """Count the connection in, or say which cap it breaks (it is then not counted)."""
        refusal = self._check(address, fd)
        if refusal is not None:
            self.refused[refusal.cap] += 1
            return refusal
        self.open += 1
        self.admitted += 1
        if address is not None:
            self.per_address[address] += 1
        return Admitted(address)

    def _check(self, address: str | None, fd: int | None) -> Refusal | None:
        limits = self.limits
        if self.open >= limits.max_connections:
            return Refusal(
                "connections",
                limits.max_connections,
                f"the server holds {self.open} connections, its limit; try again later",
            )
        if address is not None and self.per_address[address] >= self.max_per_address:
            return Refusal(
                "connections_per_address",
                self.max_per_address,
                f"the server holds {self.per_address[address]} connections from {address}, "
                f"the limit per client address; close some or try again later",
            )
        if fd is not None and self.fd_limit is not None and self.fd_ceiling is not None and fd >= self.fd_ceiling:
            return Refusal(
                "file_descriptors",
                self.fd_ceiling,
                f"the server process has {fd} or more files open of its limit of {self.fd_limit} "
                f"({self.fd_limit - self.fd_ceiling} kept for its own files); try again later",
            )
        return None

    def buffer(self, connection: Admitted, pending: int) -> Refusal | None:
        """The connection now buffers ``pending`` bytes of an unfinished frame.

        More than before, past ``max_buffered`` for the whole server: refused, and
        the caller closes it (then ``close`` lets go of what it held). Closing,
        rather than no longer reading it, cannot deadlock: connections that each
        wait for budget held by the others' half frames would wait forever.
        """
        grown = pending - connection.buffered
        if grown > 0 and self.buffered + grown > self.max_buffered:
            self.refused["buffered_bytes"] += 1
            return Refusal(
                "buffered_bytes",
                self.max_buffered,
                f"the server buffers {self.buffered} bytes of unfinished frames and this one would add "
                f"{grown}, past its limit of {self.max_buffered}; try again later",
            )
        self.buffered += grown
        connection.buffered = pending
        self.buffered_peak = max(self.buffered_peak, self.buffered)
        return None

    def close(self, connection: Admitted) -> None:
        self.open -= 1
        self.buffered -= connection.buffered
        connection.buffered = 0
        address = connection.address
        if address is not None:
            self.per_address[address] -= 1
            if not self.per_address[address]:
                del self.per_address[address]


class RefusalLog:
    """Whether to log a refusal now: the first of a kind, then at most one per ``interval`` seconds.

    ``note`` returns how many happened since the last line (this one included),
    or None to stay quiet, so a flood shows as a line a minute with a count.
    """

    def __init__(self, interval: float = 60.0) -> None:
        self.interval = interval
        self._last: dict[str, float] = {}
        self._since: Counter[str] = Counter()

    def note(self, kind: str, now: float) -> int | None:
        self._since[kind] += 1
        last = self._last.get(kind)
        if last is not None and now - last < self.interval:
            return None
        self._last[kind] = now
        count = self._since.pop(kind)
        return count


__all__ = [
    "CAPS",
    "Admitted",
    "ConnectionAdmission",
    "Refusal",
    "RefusalLog",
    "open_file_limit",
    "spare_fds_for",
]
