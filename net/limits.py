"""What a process's connections may hold, and how they are secured: the codec's size limits
(``delaymq.protocol.limits.CodecLimits``) plus connection caps, TLS and tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

from delaymq.net.auth import TokenFile
from delaymq.net.tls import TlsSettings
from delaymq.protocol.limits import CodecLimits


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectionLimits:
    """What one server grants its clients' connections, so a flood cannot lock others out.

    - ``max_connections``: connections open at once; beyond it a new one is
      answered with an ``unavailable`` error frame and closed.
    - ``max_per_address``: connections open at once from one client address;
      never more than half of what the server can hold (``max_connections``,
      or the descriptors under its file limit), so one address cannot take all.
    - ``spare_fds``: file descriptors kept free for the server's own files and
      outgoing connections: a connection that would leave fewer is refused the
      same way. None: an eighth of the process's open-file limit, 64 to 1,024.
    - ``idle_timeout``: seconds a connection may sit with no request in flight and
      no bytes received before it is closed (a long poll in flight is not idle).
    - ``frame_timeout``: seconds a frame may take from its first byte to its
      last (a half-sent frame holds memory), and an answer to be written.
    - ``max_buffered``: bytes of partial frames the server holds across all its
      connections; the connection whose frame would go past it is answered
      ``unavailable`` and closed. None: twice ``Limits.max_frame``.
    - ``max_in_flight``: requests one connection may have in flight (being
      handled, answers not yet written); at the cap the server stops reading that
      connection until one is answered (back-pressure: the client's requests wait
      in its socket, none is refused), so a client cannot start unbounded work.
    """

    max_connections: int = 10_000
    max_per_address: int = 1_000
    spare_fds: int | None = None
    idle_timeout: float = 300.0
    frame_timeout: float = 60.0
    max_buffered: int | None = None
    max_in_flight: int = 1024

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_per_address", "spare_fds", "max_buffered", "max_in_flight"):
            value = getattr(self, name)
            if value is None and name in ("spare_fds", "max_buffered"):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ConnectionLimits.{name} must be a whole number of at least 1, not {value!r}")
        for name in ("idle_timeout", "frame_timeout"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value < float("inf"):
                raise ValueError(f"ConnectionLimits.{name} must be a number of seconds above 0, not {value!r}")


DEFAULT_CONNECTION_LIMITS = ConnectionLimits()


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits(CodecLimits):
    """The codec's limits, and what the process's network layer grants and presents.

    ``connections`` is what a server grants its clients' connections; clients ignore it.
    ``tls`` secures the process's listener and the connections it dials (None: plaintext).
    ``token`` is the secret the process presents on each connection it dials (an AUTH request
    first; None: none); ``tokens`` the table a server's listener checks every request against
    (``auth.TokenFile``; None: anyone may do anything, so such a server belongs on loopback).
    """

    connections: ConnectionLimits = DEFAULT_CONNECTION_LIMITS
    tls: TlsSettings | None = None
    token: str | None = field(default=None, repr=False)
    tokens: TokenFile | None = None

    def __post_init__(self) -> None:
        super(Limits, self).__post_init__()
        if not isinstance(self.connections, ConnectionLimits):
            raise ValueError(f"Limits.connections must be a ConnectionLimits, not {self.connections!r}")
        if self.token is not None and (not isinstance(self.token, str) or not self.token.strip()):
            raise ValueError("Limits.token must be a non-empty string or None")
        if self.tokens is not None and not isinstance(self.tokens, TokenFile):
            raise ValueError(f"Limits.tokens must be a TokenFile or None, not {type(self.tokens).__name__}")


DEFAULT_LIMITS = Limits()

__all__ = ["DEFAULT_CONNECTION_LIMITS", "DEFAULT_LIMITS", "ConnectionLimits", "Limits"]
