"""The record envelope: the one framing shared by the wire and every log.

Every record, whether a message on the wire, a message in the message log, or an
entry of a dispatch log, is ``header + payload``::

    offset size  field
    0      4     payload_size  u32 big-endian
    4      1     magic         0xD7
    5      1     version       1
    6      2     kind          u16 (what the payload is: see ``RecordKind``)
    8      4     crc           CRC-32 of bytes 0..8 and of the payload

A batch is records laid end to end, so a server appends a batch it received to
a log as is, and a log is scanned and recovered with the same code that checks a
batch on the wire. The CRC covers the size and kind too, so a flipped header byte
is caught like a flipped payload byte.
"""

from __future__ import annotations

import enum
import struct
import zlib
from collections.abc import Iterator
from typing import NamedTuple

HEADER = struct.Struct(">IBBHI")
HEADER_SIZE = HEADER.size  # 12
MAGIC = 0xD7
VERSION = 1
_PREFIX = struct.Struct(">IBBH")


class RecordKind(enum.IntEnum):
    """What a record's payload holds. New kinds get new numbers, never reused."""

    MESSAGE = 1
    DISPATCH = 2
    STATE = 3
    PROGRESS = 4  # a realtime master's consumer progress, shipped to its slaves in the message log
    CANCEL = 5  # a scheduler's cancel of scheduled messages by id (docs/cancel.md)
    MOVE = 6  # a scheduler's move of scheduled messages to a new time (docs/cancel.md)
    LATE = 7  # a scheduler's message records received already due, with when they were received
    OPAQUE = 15


class EnvelopeError(ValueError):
    """A record that does not check: ``offset`` is where it starts in the buffer."""

    def __init__(self, reason: str, offset: int) -> None:
        super().__init__(f"{reason} (record at byte {offset})")
        self.reason = reason
        self.offset = offset


class TruncatedRecord(EnvelopeError):
    """The buffer ends inside a record: a torn write, or more bytes to come."""


class CorruptRecord(EnvelopeError):
    """Bad magic, unknown version, bad CRC or an oversize record."""


class Span(NamedTuple):
    """Where one record sits in a buffer: ``buf[start:end]`` is the whole record,
    ``buf[start + HEADER_SIZE:end]`` its payload."""

    start: int
    end: int
    kind: int


def encode(kind: int, payload: bytes | bytearray | memoryview) -> bytes:
    """Wrap one payload in an envelope."""
    prefix = _PREFIX.pack(len(payload), MAGIC, VERSION, kind)
    crc = zlib.crc32(payload, zlib.crc32(prefix))
    return prefix + crc.to_bytes(4, "big") + bytes(payload)


def iter_spans(
    buf: bytes | bytearray | memoryview,
    start: int = 0,
    end: int | None = None,
    *,
    max_payload: int = 1 << 31,
) -> Iterator[Span]:
    """Yield the span of each record in ``buf[start:end]``, checking each one.

    Raises ``TruncatedRecord`` when the buffer stops inside a record and
    ``CorruptRecord`` for a record that does not check; the spans already
    yielded are intact, which is what log recovery relies on.
    """
    view = memoryview(buf)
    stop = len(view) if end is None else end
    pos = start
    unpack = HEADER.unpack_from
    crc32 = zlib.crc32
    while pos < stop:
        if stop - pos < HEADER_SIZE:
            raise TruncatedRecord("truncated record header", pos)
        size, magic, version, kind, crc = unpack(view, pos)
        if magic != MAGIC:
            raise CorruptRecord(f"bad record magic 0x{magic:02x}", pos)
        if version != VERSION:
            raise CorruptRecord(f"unknown record version {version}", pos)
        if size > max_payload:
            raise CorruptRecord(f"record payload of {size} bytes exceeds {max_payload}", pos)
        body_end = pos + HEADER_SIZE + size
        if body_end > stop:
            raise TruncatedRecord("truncated record payload", pos)
        if crc32(view[pos + HEADER_SIZE : body_end], crc32(view[pos : pos + 8])) != crc:
            raise CorruptRecord("bad record CRC", pos)
        yield Span(pos, body_end, kind)
        pos = body_end


def valid_prefix(buf: bytes | bytearray | memoryview, start: int = 0) -> tuple[int, EnvelopeError | None]:
    """How far ``buf`` holds intact records from ``start``, and why it stops there.

    Log recovery truncates a segment to the returned end.
    """
    pos = start
    try:
        for span in iter_spans(buf, start):
            pos = span.end
    except EnvelopeError as error:
        return pos, error
    return pos, None
