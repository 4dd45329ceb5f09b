"""Redelivery: a stored record again with a new ``deliver_at`` or ``attempts``, and a fresh CRC.

Both fields sit at fixed offsets (``delaymq.protocol.layout``), so a retry or a
moved message rewrites them in place rather than decoding and encoding the record.
"""

from __future__ import annotations

import zlib

from delaymq.protocol.envelope import HEADER_SIZE, EnvelopeError, iter_spans
from delaymq.protocol.errors import RemoteProtocolError
from delaymq.protocol.layout import (
    ATTEMPTS_FIELD,
    ATTEMPTS_OFFSET,
    CRC_FIELD,
    CRC_OFFSET,
    DELIVER_AT_FIELD,
    DELIVER_AT_OFFSET,
    MAX_ATTEMPTS,
    MESSAGE_KIND,
    RECORD_HEADER_SIZE,
    check_delivery_fields,
)
from delaymq.protocol.refusals import envelope_code


def rewrite_delivery(record: bytes | bytearray | memoryview, *, deliver_at: int, attempts: int) -> bytes:
    """The same record with a new ``deliver_at`` and ``attempts`` and a fresh CRC.

    ``record`` must be exactly one intact message record: its CRC is checked
    before a new one is written, so a corrupt record is never laundered.
    """
    check_delivery_fields(deliver_at=deliver_at, created_at=0, attempts=attempts)
    data = bytearray(record)
    try:
        span = next(iter_spans(data, max_payload=len(data)), None)
    except EnvelopeError as error:
        code, field, limit = envelope_code(error, len(data))
        raise RemoteProtocolError(f"cannot rewrite: {error.reason}", code=code, field=field, limit=limit) from None
    if span is None or span.end != len(data):
        raise RemoteProtocolError(
            f"cannot rewrite: expected one record, got {len(data)} bytes holding "
            f"{'none' if span is None else 'more than one'}",
            code="bad_record",
        )
    if span.kind != MESSAGE_KIND or len(data) < RECORD_HEADER_SIZE:
        raise RemoteProtocolError(
            f"cannot rewrite: record of kind {span.kind} and {len(data)} bytes is not a message",
            code="bad_record",
            field="kind",
        )
    DELIVER_AT_FIELD.pack_into(data, DELIVER_AT_OFFSET, deliver_at)
    ATTEMPTS_FIELD.pack_into(data, ATTEMPTS_OFFSET, attempts)
    with memoryview(data) as view:
        crc = zlib.crc32(view[HEADER_SIZE:], zlib.crc32(view[:CRC_OFFSET]))
    CRC_FIELD.pack_into(data, CRC_OFFSET, crc)
    return bytes(data)


def redeliver_at(record: bytes | bytearray | memoryview, deliver_at: int) -> bytes:
    """The record again for ``deliver_at`` (same id, body and ``attempts``), fresh CRC: a moved message."""
    attempts = ATTEMPTS_FIELD.unpack_from(record, ATTEMPTS_OFFSET)[0]
    return rewrite_delivery(record, deliver_at=deliver_at, attempts=attempts)


def raise_attempts(record: bytes | bytearray | memoryview, by: int) -> bytes:
    """The record handed out again: ``attempts`` raised by ``by`` (capped at ``MAX_ATTEMPTS``), fresh CRC."""
    deliver_at = DELIVER_AT_FIELD.unpack_from(record, DELIVER_AT_OFFSET)[0]
    attempts = min(ATTEMPTS_FIELD.unpack_from(record, ATTEMPTS_OFFSET)[0] + by, MAX_ATTEMPTS)
    return rewrite_delivery(record, deliver_at=deliver_at, attempts=attempts)


__all__ = ["raise_attempts", "redeliver_at", "rewrite_delivery"]
