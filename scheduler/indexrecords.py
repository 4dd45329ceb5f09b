"""What the id index reads from the message log: index keys of message records, and the
CANCEL and MOVE records (``delaymq.scheduler.idindex`` holds the index itself, in lmdb).

Bytes in, keys out: nothing here touches lmdb or a file. A message record's **index key**
is its id; a retry's (``attempts`` > 0) is ``id NUL attempts NUL subject-hash``
(``index_key``); a message whose id a message of another subject took is indexed under
``id NUL NUL subject-hash`` (``displaced_key``). Its **key hash** is BLAKE2b-128 of
``subject NUL key`` (``key_hash``), from the ``key`` property. ``record_index_key`` is
what replay's filing asks, read at fixed offsets; ``record_key`` decodes in full.

Two envelope kinds of the message log carry cancels and moves, replicated and
replayed like a SCHEDULE batch:

- ``CANCEL_KIND`` (5): i64 0, i64 the time it was taken (epoch ms), then the msgpack
  list of the index keys the master decided to cancel;
- ``MOVE_KIND`` (6): message records end to end, each the moved message with its new
  ``deliver_at`` (same id, body, attempts): filing cancels the index key's current
  entry and files the record as a new one.

A third carries SCHEDULEd records that came after their moment:

- ``LATE_KIND`` (7): i64 the time it was received (epoch ms), i64 0, then message records
  end to end, each with the ``deliver_at`` its producer asked for (before that time):
  filing files them at that time, so they are delivered at once and carry their own
  ``deliver_at`` (what lateness is measured against).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable

import msgpack

from delaymq.protocol.cancel import KEY_PROPERTY, check_key
from delaymq.protocol.envelope import HEADER_SIZE, RecordKind, encode, iter_spans
from delaymq.protocol.errors import LocalProtocolError

#: Envelope kinds of the scheduler's message log besides MESSAGE.
CANCEL_KIND = int(RecordKind.CANCEL)
MOVE_KIND = int(RecordKind.MOVE)
LATE_KIND = int(RecordKind.LATE)  # records a SCHEDULE received after their moment
#: Where a LATE record's first message record starts: after its header, filed_at and a zero.
LATE_RECORDS_AT = HEADER_SIZE + 16

_FIELDS = struct.Struct(">HHHBBHI")  # attempts .. props_len, at byte 28 of a message record
_NAMES = struct.Struct(">HH")  # id_len, subject_len, at byte 30 of a message record
_NUL2 = "\x00\x00"
DISPLACED_SEPARATOR = b"\x00\x00"  # between a displaced key's id and subject hash
#: attempts, id_len and props_len of a message record, at byte ``KEY_FIELDS_AT``: whether
#: its index key is just its id (at byte ``ID_AT``), what replay's hot loop reads.
KEY_FIELDS = struct.Struct(">HH6xI")
KEY_FIELDS_AT = 28
ID_AT = 46
_TIMES = struct.Struct(">qq")
#: Every msgpack spelling of the str "key" holds these bytes: a properties map without
#: them has no ``key`` property, and filing does not decode it.
_KEY_PACKED = b"key"
_ONLY_KEY = b"\x81\xa3key"  # a map of one entry, "key"
_blake2b = hashlib.blake2b
KEY_HASH_SIZE = 16


# ------------------------------------------------------------------ index keys


def subject_hash(subject: str | bytes) -> str:
    """BLAKE2b-64 of the subject's UTF-8 bytes, in hex: how retry and displaced keys name it."""
    data = subject.encode() if isinstance(subject, str) else bytes(subject)
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def index_key(message_id: str, subject: str, attempts: int) -> str:
    """The id; for a retry (``attempts`` > 0) ``id NUL attempts NUL subject-hash``."""
    if not attempts:
        return message_id
    return f"{message_id}\x00{attempts}\x00{subject_hash(subject)}"


def displaced_key(message_id: str, subject: str | bytes) -> str:
    """``id NUL NUL subject-hash``: where a message of ``subject`` is indexed once a message
    of another subject filed the same id after it (``scheduler.displaced``)."""
    return f"{message_id}{_NUL2}{subject_hash(subject)}"


def is_displaced(key: str) -> bool:
    """A ``displaced_key`` (a retry's key has its attempts between the NULs)."""
    return _NUL2 in key


def message_id_of(key: str) -> str:
    """The message id an index key names."""
    return key.partition("\x00")[0]


def record_subject(buf: bytes | memoryview, pos: int) -> bytes:
    """The subject (UTF-8) of the message record at ``buf[pos:]``, read at fixed offsets."""
    id_len, subject_len = _NAMES.unpack_from(buf, pos + 30)
    p = pos + ID_AT + id_len
    return bytes(buf[p : p + subject_len])


def key_hash(subject: str, key: str) -> bytes:
    return hashlib.blake2b(f"{subject}\x00{key}".encode(), digest_size=KEY_HASH_SIZE).digest()


def record_key(buf: bytes | memoryview, pos: int, *, strict: bool = False) -> tuple[str, bytes | None, str | None]:
    """``(index key, key hash or None, business key or None)`` of the message record at ``buf[pos:]``
    (checked when it was received; a properties map that does not decode has no key).
    ``strict``: a ``key`` property that is not a business key raises ``ValueError``."""
    attempts, id_len, subject_len, _tags, _flags, tags_len, props_len = _FIELDS.unpack_from(buf, pos + 28)
    p = pos + ID_AT
    message_id = bytes(buf[p : p + id_len]).decode()
    if not attempts and not props_len:
        return message_id, None, None
    subject = bytes(buf[p + id_len : p + id_len + subject_len]).decode()
    found_key = None
    if props_len:
        q = p + id_len + subject_len + tags_len
        if not strict and bytes(buf[q : q + props_len]).find(_KEY_PACKED) < 0:
            props_len = 0  # no "key" in the map: nothing to decode
    if props_len:
        try:
            properties = msgpack.unpackb(bytes(buf[q : q + props_len]), raw=False)
        except Exception:
            properties = None
        if isinstance(properties, dict) and KEY_PROPERTY in properties:
            value = properties[KEY_PROPERTY]
            if strict:
                try:
                    check_key(value, error=LocalProtocolError)
                except LocalProtocolError as error:
                    raise ValueError(error.message) from None
            if isinstance(value, str) and value:
                found_key = value
    hashed = key_hash(subject, found_key) if found_key is not None else None
    return index_key(message_id, subject, attempts), hashed, found_key


def record_index_key(buf: bytes, pos: int) -> tuple[bytes, bytes | None]:
    """``(index key as UTF-8, key hash or None)`` of the message record at ``buf[pos:]``: what
    filing needs, read at fixed offsets (no decoding unless the record is a retry or its
    properties spell ``key``)."""
    if type(buf) is not bytes:
        found, hashed, _key = record_key(buf, pos)
        return found.encode(), hashed
    attempts, id_len, subject_len, _tags, _flags, tags_len, props_len = _FIELDS.unpack_from(buf, pos + 28)
    p = pos + ID_AT
    if not attempts:
        if not props_len:
            return buf[p : p + id_len], None
        q = p + id_len + subject_len + tags_len
        if buf.find(_KEY_PACKED, q, q + props_len) < 0:
            return buf[p : p + id_len], None
        # The common map, {"key": K} with K a short str (fixstr): hash its bytes as they are.
        if buf.startswith(_ONLY_KEY, q) and props_len > 6 and buf[q + 5] == 0xA0 + props_len - 6:
            s = p + id_len
            digest = _blake2b(buf[s : s + subject_len] + b"\x00" + buf[q + 6 : q + props_len], digest_size=16)
            return buf[p : p + id_len], digest.digest()
    key, hashed, _found = record_key(buf, pos)
    return key.encode(), hashed


# ------------------------------------------------------------------ records


def cancel_record(keys: Iterable[str], *, taken_at: int = 0) -> bytes:
    """The CANCEL record: 16 bytes where a message keeps ``deliver_at`` (0) and ``created_at``
    (``taken_at``), so every record of the log has them, then the msgpack list of keys."""
    return encode(CANCEL_KIND, _TIMES.pack(0, taken_at) + msgpack.packb(list(keys), use_bin_type=True))


def cancel_keys(payload: bytes | memoryview) -> list[str]:
    keys = msgpack.unpackb(bytes(payload[_TIMES.size :]), raw=False)
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise ValueError("a CANCEL record's payload is not a msgpack list of str")
    return keys


def move_record(records: Iterable[bytes]) -> bytes:
    return encode(MOVE_KIND, b"".join(records))


def late_record(records: Iterable[bytes], *, filed_at: int) -> bytes:
    """The LATE record: 16 bytes where a message keeps ``deliver_at`` (``filed_at``, when they
    are filed for) and ``created_at`` (0), then the records, each with its own ``deliver_at``."""
    return encode(LATE_KIND, _TIMES.pack(filed_at, 0) + b"".join(records))


def move_spans(buf: bytes | memoryview, start: int, end: int) -> list[tuple[int, int]]:
    """``(start, end)`` in ``buf`` of each message record inside the MOVE record at ``buf[start:end]``."""
    return [(span.start, span.end) for span in iter_spans(buf, start + HEADER_SIZE, end)]


__all__ = [
    "CANCEL_KIND",
    "DISPLACED_SEPARATOR",
    "ID_AT",
    "KEY_FIELDS",
    "KEY_FIELDS_AT",
    "KEY_HASH_SIZE",
    "LATE_KIND",
    "LATE_RECORDS_AT",
    "MOVE_KIND",
    "cancel_keys",
    "cancel_record",
    "displaced_key",
    "index_key",
    "is_displaced",
    "key_hash",
    "late_record",
    "message_id_of",
    "move_record",
    "move_spans",
    "record_index_key",
    "record_key",
    "record_subject",
    "subject_hash",
]
