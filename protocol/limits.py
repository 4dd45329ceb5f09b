"""Size limits of frames and message records, shared by both ends of the wire.

A producer checks them before it sends (``LocalProtocolError``), a server checks
them on every record it receives (``RemoteProtocolError``), so a refusal always
names the field and the limit it broke. Each limit is configurable; the record
layout itself caps some of them (see ``Limits.__post_init__``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from delaymq.protocol.auth import TokenFile
from delaymq.protocol.tls import TlsSettings

KiB = 1024
MiB = 1024 * KiB

#: The default horizon of a delayed message: two (leap) years ahead.
TWO_YEARS_MS = 2 * 366 * 86_400_000

# Limits of the consumer commands, the same for the client that asks and the
# realtime server that checks.
#: Longest consumer group or consumer name, in UTF-8 bytes.
MAX_NAME = 255
#: Most messages one PULL may ask for.
MAX_PULL = 10_000
#: Longest long poll a PULL may ask for, and the one it gets when it names none.
MAX_POLL_MS = 300_000
DEFAULT_POLL_MS = 30_000
#: Furthest ahead of their ``deliver_at`` a PULL may take records a scheduler sent
#: ahead (``ahead_ms``): the consumer holds them until due. Bounded so a hand-out's
#: ack timeout, which starts at the hand-out, is not spent waiting.
MAX_PULL_AHEAD_MS = 1_000
#: Room kept in a frame for its header and metadata (a SEND's, a PULL answer's).
FRAME_RESERVE = 64 * KiB
#: The largest frame a connection may send before its AUTH is accepted, on a server
#: with a tokens file (AUTH and PING only, until then).
MAX_UNAUTHENTICATED_FRAME = 64 * KiB
#: Most objects (maps, arrays, strings, numbers, ...) and deepest nesting of maps and
#: arrays in the metadata of a request, counted before it is decoded.
MAX_METADATA_ITEMS = 100_000
MAX_METADATA_DEPTH = 32

#: Bytes of the fixed message header in a record's payload (offsets 12..46), which
#: ``max_record`` counts; ``delaymq.protocol.records`` lays it out and checks its size.
MESSAGE_HEADER_SIZE = 34

# Caps set by the widths of the record and frame header fields.
_U8 = 0xFF
_U16 = 0xFFFF
_U32 = 0xFFFF_FFFF


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
class Limits:
    """Every limit of the codec, in bytes unless said otherwise.

    ``max_metadata`` caps a frame's msgpack metadata, checked from its header
    before it is decoded (a request's is also walked for ``MAX_METADATA_ITEMS``
    and ``MAX_METADATA_DEPTH`` first). ``max_subject``, ``max_id`` and ``max_tag`` count UTF-8 bytes, not
    characters; ``max_properties`` is the size of the msgpack encoding;
    ``horizon_ms`` is how far past "now" a ``deliver_at`` may lie (checked by
    ``scan_batch`` when it is given ``now_ms``). ``connections`` is what a
    server grants its clients' connections; clients ignore it. ``tls`` secures
    the process's listener and the connections it dials (None: plaintext).
    ``token`` is the secret the process presents on each connection it dials
    (an AUTH request first; None: none); ``tokens`` the table a server's
    listener checks every request against (``auth.TokenFile``; None: anyone may
    do anything, so such a server belongs on loopback).
    """

    max_frame: int = 64 * MiB
    max_metadata: int = 4 * MiB
    max_body: int = 4 * MiB
    max_subject: int = 255
    max_id: int = 64
    max_tags: int = 16
    max_tag: int = 64
    max_properties: int = 64 * KiB
    horizon_ms: int = TWO_YEARS_MS
    connections: ConnectionLimits = DEFAULT_CONNECTION_LIMITS
    tls: TlsSettings | None = None
    token: str | None = field(default=None, repr=False)
    tokens: TokenFile | None = None

    def __post_init__(self) -> None:
        caps = {
            "max_frame": _U32,
            "max_metadata": _U32,
            "max_body": _U32,
            "max_subject": _U16,
            "max_id": _U16,
            "max_tags": _U8,
            "max_tag": _U8,
            "max_properties": _U32,
            "horizon_ms": 1 << 62,
        }
        for name, cap in caps.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= cap:
                raise ValueError(f"Limits.{name} must be an int from 1 to {cap}, not {value!r}")
        # 255 tags of (1 + 255) bytes still fit the u16 tag-section length.
        if not isinstance(self.connections, ConnectionLimits):
            raise ValueError(f"Limits.connections must be a ConnectionLimits, not {self.connections!r}")
        if self.token is not None and (not isinstance(self.token, str) or not self.token.strip()):
            raise ValueError("Limits.token must be a non-empty string or None")
        if self.tokens is not None and not isinstance(self.tokens, TokenFile):
            raise ValueError(f"Limits.tokens must be a TokenFile or None, not {type(self.tokens).__name__}")

    @property
    def max_record(self) -> int:
        """The largest record payload these limits allow (header and all fields)."""
        return (
            MESSAGE_HEADER_SIZE
            + self.max_id
            + self.max_subject
            + self.max_tags * (1 + self.max_tag)
            + self.max_properties
            + self.max_body
        )


DEFAULT_LIMITS = Limits()

__all__ = [
    "DEFAULT_CONNECTION_LIMITS",
    "DEFAULT_LIMITS",
    "ConnectionLimits",
    "DEFAULT_POLL_MS",
    "FRAME_RESERVE",
    "MAX_METADATA_DEPTH",
    "MAX_METADATA_ITEMS",
    "MAX_NAME",
    "MAX_UNAUTHENTICATED_FRAME",
    "MAX_POLL_MS",
    "MAX_PULL_AHEAD_MS",
    "MAX_PULL",
    "MESSAGE_HEADER_SIZE",
    "KiB",
    "Limits",
    "MiB",
    "TWO_YEARS_MS",
]
