"""The message record: the one format of a message on the wire and in every log.

A message is the payload of an envelope record (``delaymq.protocol.envelope``)
of kind ``RecordKind.MESSAGE``; the envelope's CRC covers it. Here are the
``Message`` type and the record's encoding and decoding; the rest of the codec
sits in modules of its own, and every name is importable from here too:

- ``delaymq.protocol.layout``: the byte layout, header structs and field offsets;
- ``delaymq.protocol.scan``: ``scan_batch``, the validator of every received batch,
  and the ``MessageBatch`` it returns (``delaymq.protocol.refusals`` names what it refuses);
- ``delaymq.protocol.properties``: the msgpack properties map;
- ``delaymq.protocol.redelivery``: ``rewrite_delivery`` and the retries built on it;
- ``delaymq.protocol.ids`` and ``delaymq.protocol.tagmask``: message ids and tag bits.
"""

from __future__ import annotations

import itertools
import struct
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from delaymq.protocol.envelope import HEADER, HEADER_SIZE, MAGIC, VERSION
from delaymq.protocol.errors import LocalProtocolError, RemoteProtocolError
from delaymq.protocol.fields import encode_name
from delaymq.protocol.ids import new_message_id
from delaymq.protocol.layout import (
    BODY_LEN_FIELD,
    BODY_LEN_OFFSET,
    CRC_PREFIX,
    I64_MAX,
    MAX_ATTEMPTS,
    MESSAGE_HEADER,
    MESSAGE_HEADER_SIZE,
    MESSAGE_KIND,
    RECORD_HEADER,
    RECORD_HEADER_SIZE,
    RECORD_TIMES,
    check_delivery_fields,
    record_subject,
)
from delaymq.protocol.limits import DEFAULT_CODEC_LIMITS, CodecLimits
from delaymq.protocol.properties import encode_properties
from delaymq.protocol.redelivery import raise_attempts, redeliver_at, rewrite_delivery
from delaymq.protocol.scan import MessageBatch, MessageHeader, scan_batch, scan_records
from delaymq.protocol.tagmask import tag_bit, tags_mask


@dataclass(frozen=True, slots=True)
class Message:
    """A fully decoded message, for users; servers work on ``MessageHeader``s."""

    id: str
    subject: str
    _: KW_ONLY
    tags: tuple[str, ...] = ()
    properties: dict[str, Any] = field(default_factory=dict)
    body: bytes = b""
    deliver_at: int = 0
    created_at: int = 0
    attempts: int = 0
    #: The record ``encode`` made, and the limits it was checked against: a message checked
    #: when it is built (``producer.message``) is not encoded again when it is sent. Kept only
    #: without properties, the one field a caller could change in place. Two slots, not a
    #: tuple: one object fewer for the garbage collector per message; the bytes do not depend
    #: on the limits, so a ``_limits`` paired with another call's record is still right.
    _record: bytes | None = field(default=None, init=False, repr=False, compare=False)
    _limits: CodecLimits | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if type(self.tags) is not tuple:
            if isinstance(self.tags, str):  # a lone tag, not its characters
                raise TypeError("Message.tags is a sequence of str, not a str")
            object.__setattr__(self, "tags", tuple(self.tags))

    def encode(self, limits: CodecLimits = DEFAULT_CODEC_LIMITS) -> bytes:
        """This message as one record; ``LocalProtocolError`` names a broken limit."""
        record = self._record
        if record is not None and self._limits is limits and not self.properties:
            return record
        # Looked up in this module at each call, so a wrapped ``records.encode_message`` sees every encode.
        record = encode_message(
            self.id,
            self.subject,
            tags=self.tags,
            properties=self.properties,
            body=self.body,
            deliver_at=self.deliver_at,
            created_at=self.created_at,
            attempts=self.attempts,
            limits=limits,
        )
        if not self.properties:
            object.__setattr__(self, "_record", record)
            object.__setattr__(self, "_limits", limits)
        return record


# --------------------------------------------------------------------- encode


def encode_message(
    id: str,
    subject: str,
    *,
    tags: Iterable[str] = (),
    properties: Mapping[str, Any] | None = None,
    body: bytes = b"",
    deliver_at: int = 0,
    created_at: int = 0,
    attempts: int = 0,
    limits: CodecLimits = DEFAULT_CODEC_LIMITS,
) -> bytes:
    """One message record; ``LocalProtocolError`` names the field and limit broken."""
    id_bytes = encode_name(id, "id", limits.max_id)
    subject_bytes = encode_name(subject, "subject", limits.max_subject)
    if tags:
        tag_count, tag_bytes = _encode_tags(tags, limits)
    else:
        tag_count, tag_bytes = 0, b""
    if properties is None or (type(properties) is dict and not properties):
        props_bytes = b""
    else:
        props_bytes = encode_properties(properties, limits)
    if type(body) is not bytes:
        if not isinstance(body, bytes | bytearray | memoryview):
            raise LocalProtocolError(
                f"body is of type {type(body).__name__}, not bytes", code="bad_value", field="body"
            )
        body = bytes(body)
    if len(body) > limits.max_body:
        raise LocalProtocolError(
            f"body is {len(body)} bytes, limit {limits.max_body}",
            code="limit",
            field="body",
            limit=limits.max_body,
        )
    try:
        payload = _join(
            (
                _pack_message_header(
                    deliver_at,
                    created_at,
                    attempts,
                    len(id_bytes),
                    len(subject_bytes),
                    tag_count,
                    0,
                    len(tag_bytes),
                    len(props_bytes),
                    len(body),
                ),
                id_bytes,
                subject_bytes,
                tag_bytes,
                props_bytes,
                body,
            )
        )
    except struct.error:
        check_delivery_fields(deliver_at=deliver_at, created_at=created_at, attempts=attempts)
        raise  # pragma: no cover - the check above names the field
    size = len(payload)
    # The CRC covers the envelope header's first 8 bytes, then the payload: the header is
    # packed whole once it is known, one pack and one join fewer than three parts joined.
    crc = _crc32(payload, _crc32(_pack_prefix(size, MAGIC, VERSION, MESSAGE_KIND)))
    return _pack_envelope(size, MAGIC, VERSION, MESSAGE_KIND, crc) + payload


# Bound once: a producer encodes a record per message, and each lookup saved counts there.
_join = b"".join
_crc32 = zlib.crc32
_pack_message_header = MESSAGE_HEADER.pack
_pack_prefix = CRC_PREFIX.pack
_pack_envelope = HEADER.pack


def encode_batch(messages: Iterable[Message], limits: CodecLimits = DEFAULT_CODEC_LIMITS) -> bytes:
    """Records end to end, ready for a frame body or a log append."""
    return b"".join([message.encode(limits) for message in messages])


def _encode_tags(tags: Iterable[str], limits: CodecLimits) -> tuple[int, bytes]:
    if isinstance(tags, str):
        raise LocalProtocolError("tags is a str, not a sequence of str", code="bad_value", field="tags")
    parts = []
    for tag in tags:
        data = encode_name(tag, "tag", limits.max_tag)
        parts.append(len(data).to_bytes(1, "big"))
        parts.append(data)
    count = len(parts) // 2
    if count > limits.max_tags:
        raise LocalProtocolError(
            f"{count} tags, limit {limits.max_tags}",
            code="limit",
            field="tags",
            limit=limits.max_tags,
        )
    return count, b"".join(parts)


# --------------------------------------------------------------------- decode


def decode_message(
    buf: bytes | bytearray | memoryview, start: int = 0, *, limits: CodecLimits = DEFAULT_CODEC_LIMITS
) -> Message:
    """The full message of the record at ``buf[start:]`` (later records are ignored).

    Checks what ``scan_batch`` checks, plus the properties. Copies at most that
    record, so ``buf`` may be a whole mapped log segment.
    """
    if type(buf) is bytes:
        data, pos = buf, start
    else:  # copy just this record (``buf`` may be a whole mapped segment)
        with memoryview(buf) as view:
            stop = len(view)
            if stop - start >= 4:
                (size,) = struct.unpack_from(">I", view, start)
                stop = min(stop, start + HEADER_SIZE + min(size, limits.max_record + 1))
            data, pos = bytes(view[start:stop]), 0
    try:
        properties: list[dict[str, Any]] = []
        columns = scan_records(data, pos, len(data), limits, I64_MAX, properties, 1)
    except RemoteProtocolError as error:
        error.index = None  # one record, not a batch
        raise
    if not properties:
        raise RemoteProtocolError(f"no record at byte {start}: the buffer ends there", code="truncated")
    starts, ends, ids, subjects, tags, deliver_ats, created_ats, attempts = columns
    return _to_message(
        data,
        properties[0],
        starts[0],
        ends[0],
        ids[0],
        subjects[0],
        tags[0],
        deliver_ats[0],
        created_ats[0],
        attempts[0],
    )


def decode_batch(buf: bytes | bytearray | memoryview, limits: CodecLimits = DEFAULT_CODEC_LIMITS) -> list[Message]:
    """Every message of a batch, fully decoded (properties checked too)."""
    data = buf if type(buf) is bytes else bytes(buf)
    properties: list[dict[str, Any]] = []
    columns = scan_records(data, 0, len(data), limits, I64_MAX, properties, None)
    return list(map(_to_message, itertools.repeat(data), properties, *columns))


class _MessageSlots:
    """``Message``'s slots, plainly settable: ``make_message`` fills one and makes it a ``Message``.

    Same slots in the same order, so Python lets its class be switched to ``Message``; setting
    slots of a plain object is about twice as fast as calling each frozen slot's setter.
    """

    __slots__ = Message.__slots__


def make_message(
    id: str,
    subject: str,
    tags: tuple[str, ...],
    properties: dict[str, Any],
    body: bytes,
    deliver_at: int,
    created_at: int,
    attempts: int = 0,
    record: bytes | None = None,
    limits: CodecLimits | None = None,
) -> Message:
    """``Message(...)`` for fields already of the right types (``tags`` a tuple), at about
    a sixth of the cost: a producer builds one per message it sends, a consumer one per message received.

    ``record`` is the record already made of these fields and ``limits`` those it was checked
    against: ``encode(limits)`` then returns it (used only without properties, see ``Message``).
    """
    message: Any = _MessageSlots()
    message.id = id
    message.subject = subject
    message.tags = tags
    message.properties = properties
    message.body = body
    message.deliver_at = deliver_at
    message.created_at = created_at
    message.attempts = attempts
    message._record = record
    message._limits = limits  # every slot set: copy and pickle read them all
    message.__class__ = Message
    return message


def make_plain_message(
    subject: str, subject_bytes: bytes, body: bytes, deliver_at: int, created_at: int, limits: CodecLimits
) -> Message | None:
    """A message with a new time-ordered id (``new_message_id(created_at)``) and no tags,
    properties or attempts, encoded now, so its ``encode(limits)`` returns that record: a
    producer's common case in one call (``producer.message()``: 2.15 -> 1.71 µs).

    ``subject_bytes`` is what ``encode_name`` made of ``subject`` (the caller keeps it per
    subject); the id, hex digits, needs no check but its length. None, with nothing made, when the
    subject or the body is over its limit or a time is out of range: the caller's general
    path then names the field.
    """
    id = new_message_id(created_at)
    id_bytes = id.encode()
    if len(subject_bytes) > limits.max_subject or len(body) > limits.max_body or len(id_bytes) > limits.max_id:
        return None
    try:
        header = _pack_message_header(
            deliver_at, created_at, 0, len(id_bytes), len(subject_bytes), 0, 0, 0, 0, len(body)
        )
    except struct.error:
        return None
    payload = _join((header, id_bytes, subject_bytes, body))
    size = len(payload)
    crc = _crc32(payload, _crc32(_pack_prefix(size, MAGIC, VERSION, MESSAGE_KIND)))
    record = _pack_envelope(size, MAGIC, VERSION, MESSAGE_KIND, crc) + payload
    return make_message(id, subject, (), {}, body, deliver_at, created_at, 0, record, limits)


def _to_message(
    data: bytes,
    properties: dict[str, Any],
    start: int,
    end: int,
    message_id: str,
    subject: str,
    tags: tuple[str, ...],
    deliver_at: int,
    created_at: int,
    attempts: int,
) -> Message:
    """A checked record's ``Message``."""
    body_len = BODY_LEN_FIELD.unpack_from(data, start + BODY_LEN_OFFSET)[0]
    return make_message(
        message_id, subject, tags, properties, data[end - body_len : end], deliver_at, created_at, attempts
    )


__all__ = [
    "MAX_ATTEMPTS",
    "MESSAGE_HEADER",
    "MESSAGE_HEADER_SIZE",
    "RECORD_HEADER",
    "RECORD_HEADER_SIZE",
    "RECORD_TIMES",
    "Message",
    "MessageBatch",
    "MessageHeader",
    "decode_batch",
    "decode_message",
    "encode_batch",
    "encode_message",
    "make_message",
    "make_plain_message",
    "new_message_id",
    "raise_attempts",
    "record_subject",
    "redeliver_at",
    "rewrite_delivery",
    "scan_batch",
    "tag_bit",
    "tags_mask",
]
