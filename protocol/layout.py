"""The message record's byte layout: its header structs, field offsets and field ranges.

A message is the payload of an envelope record (``delaymq.protocol.envelope``)
of kind ``RecordKind.MESSAGE``; the envelope's CRC covers it. Integers are
big-endian, like the envelope's. Byte offsets from the start of the record (the
envelope header is bytes 0..12, the message payload starts at 12)::

    offset size  field
    0      4     payload_size  u32   envelope: bytes after byte 12
    4      1     magic         0xD7  envelope
    5      1     version       1     envelope
    6      2     kind          u16   envelope: 1 = MESSAGE
    8      4     crc           u32   envelope: CRC-32 of bytes 0..8 and 12..end
    12     8     deliver_at    i64   epoch ms UTC; 0 (or any past moment) = now
    20     8     created_at    i64   epoch ms UTC, set by the producer
    28     2     attempts      u16   deliveries tried so far (retries)
    30     2     id_len        u16   1..max_id
    32     2     subject_len   u16   1..max_subject
    34     1     tag_count     u8    0..max_tags
    35     1     flags         u8    reserved, must be 0
    36     2     tags_len      u16   bytes of the tag section
    38     4     props_len     u32   bytes of the properties, 0 = none
    42     4     body_len      u32   0..max_body
    46     .     id            UTF-8, no control characters
    .      .     subject       UTF-8, no control characters
    .      .     tags          tag_count x (u8 length, UTF-8 bytes), each 1..max_tag
    .      .     properties    msgpack map str -> str|int|float|bool|bytes
    .      .     body          opaque bytes

``payload_size == 34 + id_len + subject_len + tags_len + props_len + body_len``
always holds; a record where it does not is refused. ``deliver_at``,
``created_at`` and ``attempts`` sit at fixed offsets so a retry rewrites them
in place (``delaymq.protocol.redelivery``).
"""

from __future__ import annotations

import struct
from typing import Any

from delaymq.protocol.envelope import HEADER, HEADER_SIZE, RecordKind
from delaymq.protocol.errors import LocalProtocolError
from delaymq.protocol.limits import MESSAGE_HEADER_SIZE

#: The fixed message header inside the payload (offsets 12..46 of the record);
#: ``Limits.max_record`` counts its ``MESSAGE_HEADER_SIZE`` bytes.
MESSAGE_HEADER = struct.Struct(">qqHHHBBHII")
if MESSAGE_HEADER.size != MESSAGE_HEADER_SIZE:  # the limits would size records wrongly
    raise ImportError(f"message header is {MESSAGE_HEADER.size} bytes, limits count {MESSAGE_HEADER_SIZE}")
#: Envelope header and message header in one, so a scan unpacks once per record.
RECORD_HEADER = struct.Struct(HEADER.format + MESSAGE_HEADER.format[1:])
RECORD_HEADER_SIZE = RECORD_HEADER.size  # 46

#: The envelope header, ``deliver_at`` and ``created_at``: what filing a record by
#: its hour reads (size, magic, version, kind, crc, deliver_at, created_at).
RECORD_TIMES = struct.Struct(HEADER.format + "qq")

#: The envelope kind of every message record, as the int a header unpacks to.
MESSAGE_KIND = int(RecordKind.MESSAGE)
#: The CRC-covered part of the envelope header (bytes 0..8), and the CRC after it.
CRC_PREFIX = struct.Struct(">IBBH")
CRC_FIELD = struct.Struct(">I")
CRC_OFFSET = 8

# The fields read or rewritten on their own, each at its fixed offset.
DELIVER_AT_FIELD = struct.Struct(">q")
DELIVER_AT_OFFSET = HEADER_SIZE  # 12
ATTEMPTS_FIELD = struct.Struct(">H")
ATTEMPTS_OFFSET = 28
LENGTHS_FIELDS = struct.Struct(">HH")  # id_len, subject_len
LENGTHS_OFFSET = 30
BODY_LEN_FIELD = struct.Struct(">I")
BODY_LEN_OFFSET = 42

I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1
#: The record's ``attempts`` field is a u16: the most deliveries a message can count.
MAX_ATTEMPTS = 0xFFFF


def check_delivery_fields(*, deliver_at: Any, created_at: Any, attempts: Any) -> None:
    """Raise ``LocalProtocolError`` naming the first of the three that its header field cannot hold."""
    for name, value, low, high in (
        ("deliver_at", deliver_at, I64_MIN, I64_MAX),
        ("created_at", created_at, I64_MIN, I64_MAX),
        ("attempts", attempts, 0, MAX_ATTEMPTS),
    ):
        if not isinstance(value, int):
            raise LocalProtocolError(f"{name} is of type {type(value).__name__}, not int", code="bad_value", field=name)
        if not low <= value <= high:
            raise LocalProtocolError(
                f"{name} {value} is outside {low}..{high}",
                code="limit",
                field=name,
                limit=high,
            )


def record_subject(record: bytes | bytearray | memoryview) -> bytes:
    """The subject bytes of one message record (checked when it was received)."""
    id_len, subject_len = LENGTHS_FIELDS.unpack_from(record, LENGTHS_OFFSET)
    start = RECORD_HEADER_SIZE + id_len
    return bytes(record[start : start + subject_len])


__all__ = [
    "ATTEMPTS_FIELD",
    "ATTEMPTS_OFFSET",
    "BODY_LEN_FIELD",
    "BODY_LEN_OFFSET",
    "CRC_FIELD",
    "CRC_OFFSET",
    "CRC_PREFIX",
    "DELIVER_AT_FIELD",
    "DELIVER_AT_OFFSET",
    "I64_MAX",
    "I64_MIN",
    "LENGTHS_FIELDS",
    "LENGTHS_OFFSET",
    "MAX_ATTEMPTS",
    "MESSAGE_HEADER",
    "MESSAGE_HEADER_SIZE",
    "MESSAGE_KIND",
    "RECORD_HEADER",
    "RECORD_HEADER_SIZE",
    "RECORD_TIMES",
    "check_delivery_fields",
    "record_subject",
]
