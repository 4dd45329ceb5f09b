"""Size limits of frames and message records, shared by both ends of the wire.

A producer checks them before it sends (``LocalProtocolError``), a server checks
them on every record it receives (``RemoteProtocolError``), so a refusal always
names the field and the limit it broke. Each limit is configurable; the record
layout itself caps some of them (see ``Limits.__post_init__``).
"""

from __future__ import annotations

from dataclasses import dataclass

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
class CodecLimits:
    """Every limit of the codec, in bytes unless said otherwise.

    ``max_metadata`` caps a frame's msgpack metadata, checked from its header
    before it is decoded (a request's is also walked for ``MAX_METADATA_ITEMS``
    and ``MAX_METADATA_DEPTH`` first). ``max_subject``, ``max_id`` and ``max_tag`` count UTF-8 bytes, not
    characters; ``max_properties`` is the size of the msgpack encoding;
    ``horizon_ms`` is how far past "now" a ``deliver_at`` may lie (checked by
    ``scan_batch`` when it is given ``now_ms``). The network layer's
    ``delaymq.net.limits.Limits`` adds what connections may hold, TLS and tokens.
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


DEFAULT_CODEC_LIMITS = CodecLimits()

__all__ = [
    "DEFAULT_CODEC_LIMITS",
    "CodecLimits",
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
    "MiB",
    "TWO_YEARS_MS",
]
