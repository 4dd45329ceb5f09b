"""Naming what is wrong with a refused message record: the code, field, limit and batch index.

The scanner (``delaymq.protocol.scan``) tests each record with as few
comparisons as it can; once one fails, the functions here check that record
again, rule by rule in the scanner's fixed order (envelope, kind, layout,
limits, contents), and name the first rule broken. Only refusals run this code.
"""

from __future__ import annotations

from delaymq.protocol.envelope import EnvelopeError, iter_spans
from delaymq.protocol.errors import RemoteProtocolError
from delaymq.protocol.fields import CONTROL
from delaymq.protocol.layout import (
    LENGTHS_FIELDS,
    LENGTHS_OFFSET,
    MESSAGE_HEADER_SIZE,
    MESSAGE_KIND,
    RECORD_HEADER,
    RECORD_HEADER_SIZE,
)
from delaymq.protocol.limits import CodecLimits


def refusal(
    index: int, pos: int, message: str, code: str, field: str | None = None, limit: int | None = None
) -> RemoteProtocolError:
    """The error refusing record ``index`` of a batch, which starts at byte ``pos``."""
    return RemoteProtocolError(
        f"record {index} (byte {pos}): {message}", code=code, field=field, limit=limit, index=index
    )


def short_header(data: bytes, pos: int, stop: int) -> tuple[int, ...]:
    """The header fields of a record whose bytes end before its 46-byte header does.

    Zero-padded so the checks run in their usual order: the envelope's checks say
    where it is cut short, or a whole record is refused as too short a message.
    """
    return RECORD_HEADER.unpack(data[pos:stop].ljust(RECORD_HEADER_SIZE, b"\0"))


def envelope_refusal(data: bytes, pos: int, stop: int, index: int, max_payload: int) -> RemoteProtocolError:
    """The refusal of a record whose envelope does not check, named by the envelope's own checks."""
    try:
        next(iter_spans(data, pos, stop, max_payload=max_payload))
    except EnvelopeError as error:
        code, field, limit = envelope_code(error, max_payload)
        return refusal(index, pos, error.reason, code, field, limit)
    raise AssertionError(f"record {index} at byte {pos}: envelope refused but checks")  # pragma: no cover


def envelope_code(error: EnvelopeError, max_payload: int) -> tuple[str, str | None, int | None]:
    """Map the envelope's error to this layer's code, field and limit."""
    reason = error.reason
    if reason.startswith("truncated"):
        return "truncated", None, None
    if "magic" in reason:
        return "bad_magic", "magic", None
    if "version" in reason:
        return "unknown_version", "version", None
    if "exceeds" in reason:
        return "oversize", "record", max_payload
    if "CRC" in reason:
        return "bad_crc", "crc", None
    return "bad_record", None, None  # pragma: no cover - an envelope reason we do not know


def header_refusal(
    data: bytes, pos: int, stop: int, index: int, limits: CodecLimits, max_deliver_at: int
) -> RemoteProtocolError:
    """The refusal of a record with a sound envelope whose message header breaks a rule."""
    (
        size,
        _magic,
        _version,
        kind,
        _crc,
        deliver_at,
        _created_at,
        _attempts,
        id_len,
        subject_len,
        tag_count,
        flags,
        tags_len,
        props_len,
        body_len,
    ) = RECORD_HEADER.unpack_from(data, pos) if stop - pos >= RECORD_HEADER_SIZE else short_header(data, pos, stop)
    fixed = MESSAGE_HEADER_SIZE
    max_id, max_subject, max_tags = limits.max_id, limits.max_subject, limits.max_tags
    max_props, max_body = limits.max_properties, limits.max_body
    if kind != MESSAGE_KIND:
        return refusal(index, pos, f"record kind {kind} is not MESSAGE ({MESSAGE_KIND})", "bad_record", "kind")
    if size < fixed:
        text = f"payload of {size} bytes is shorter than the {fixed}-byte message header"
        return refusal(index, pos, text, "bad_record", "header")
    if flags:
        return refusal(index, pos, f"flags 0x{flags:02x} set, none are defined", "bad_record", "flags")
    if not 0 < id_len <= max_id:
        return refusal(index, pos, f"id is {id_len} UTF-8 bytes, must be 1 to {max_id}", "limit", "id", max_id)
    if not 0 < subject_len <= max_subject:
        text = f"subject is {subject_len} UTF-8 bytes, must be 1 to {max_subject}"
        return refusal(index, pos, text, "limit", "subject", max_subject)
    if tag_count > max_tags:
        return refusal(index, pos, f"{tag_count} tags, limit {max_tags}", "limit", "tags", max_tags)
    if props_len > max_props:
        text = f"properties are {props_len} bytes, limit {max_props}"
        return refusal(index, pos, text, "limit", "properties", max_props)
    if body_len > max_body:
        return refusal(index, pos, f"body is {body_len} bytes, limit {max_body}", "limit", "body", max_body)
    fields = fixed + id_len + subject_len + tags_len + props_len + body_len
    if size != fields:
        return refusal(
            index, pos, f"payload is {size} bytes but its fields add up to {fields}", "bad_record", "lengths"
        )
    if deliver_at > max_deliver_at:
        horizon = limits.horizon_ms
        text = f"deliver_at {deliver_at} is beyond the horizon of {horizon} ms (latest {max_deliver_at})"
        return refusal(index, pos, text, "limit", "deliver_at", horizon)
    raise AssertionError(f"record {index} at byte {pos}: header refused but checks")  # pragma: no cover


def text_refusal(data: bytes, pos: int, index: int) -> RemoteProtocolError:
    """The refusal of a record whose id or subject is not UTF-8 or holds a control character."""
    id_len, subject_len = LENGTHS_FIELDS.unpack_from(data, pos + LENGTHS_OFFSET)
    start = pos + RECORD_HEADER_SIZE
    for field, stop in (("id", start + id_len), ("subject", start + id_len + subject_len)):
        try:
            value = data[start:stop].decode()
        except UnicodeDecodeError as error:
            return refusal(index, pos, f"{field} {not_utf8(error)}", "bad_value", field)
        if CONTROL.search(value):
            return refusal(index, pos, f"{field} {value!r} holds a control character", "bad_value", field)
        start = stop
    raise AssertionError(f"record {index} at byte {pos}: text refused but checks")  # pragma: no cover


def not_utf8(error: UnicodeDecodeError) -> str:
    return f"is not valid UTF-8 ({error.reason} at byte {error.start})"


__all__ = [
    "envelope_code",
    "envelope_refusal",
    "header_refusal",
    "not_utf8",
    "refusal",
    "short_header",
    "text_refusal",
]
