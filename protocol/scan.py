"""The validating scanner: every record of a received batch checked, its header fields read.

A batch is records end to end, so a server checks a batch with ``scan_batch``
and appends the very same bytes to its log. The scanner is the one validator of
message records; ``decode_message`` and ``decode_batch`` run it too.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

from delaymq.protocol.envelope import MAGIC, VERSION
from delaymq.protocol.fields import CONTROL
from delaymq.protocol.layout import I64_MAX, MESSAGE_HEADER_SIZE, MESSAGE_KIND, RECORD_HEADER, RECORD_HEADER_SIZE
from delaymq.protocol.limits import DEFAULT_CODEC_LIMITS, CodecLimits
from delaymq.protocol.properties import decode_properties
from delaymq.protocol.refusals import (
    envelope_refusal,
    header_refusal,
    not_utf8,
    refusal,
    short_header,
    text_refusal,
)

#: What a scan collects, one list per header field: starts, ends, ids, subjects,
#: tags, deliver_ats, created_ats, attempts (entry ``i`` of each is record ``i``).
Columns = tuple[
    list[int],
    list[int],
    list[str],
    list[str],
    list[tuple[str, ...]],
    list[int],
    list[int],
    list[int],
]


class MessageHeader(NamedTuple):
    """One record of a ``MessageBatch``: everything but properties and body.

    ``buf[start:end]`` is the whole record.
    """

    start: int
    end: int
    id: str
    subject: str
    tags: tuple[str, ...]
    deliver_at: int
    created_at: int
    attempts: int


@dataclass(frozen=True, slots=True)
class MessageBatch:
    """A checked batch: the scanned bytes and, per record, its header fields.

    The fields are parallel lists (entry ``i`` of each is record ``i``): that
    is what a server loops over, and it allocates no object per record (faster
    than a list of tuples, and no work for the garbage collector). Indexing or
    iterating gives ``MessageHeader``s for convenience.
    """

    buf: bytes
    starts: list[int]
    ends: list[int]
    ids: list[str]
    subjects: list[str]
    tags: list[tuple[str, ...]]
    deliver_ats: list[int]
    created_ats: list[int]
    attempts: list[int]

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> MessageHeader:
        return MessageHeader(
            self.starts[index],
            self.ends[index],
            self.ids[index],
            self.subjects[index],
            self.tags[index],
            self.deliver_ats[index],
            self.created_ats[index],
            self.attempts[index],
        )

    def __iter__(self) -> Iterator[MessageHeader]:
        return map(
            MessageHeader,
            self.starts,
            self.ends,
            self.ids,
            self.subjects,
            self.tags,
            self.deliver_ats,
            self.created_ats,
            self.attempts,
        )

    def record(self, index: int) -> bytes:
        """The bytes of one record, e.g. to forward it alone."""
        return self.buf[self.starts[index] : self.ends[index]]


def scan_batch(
    buf: bytes | bytearray | memoryview,
    limits: CodecLimits = DEFAULT_CODEC_LIMITS,
    *,
    now_ms: int | None = None,
    check_properties: bool = False,
) -> MessageBatch:
    """Check every record of a received batch and read its header fields.

    Checks the envelope (magic, version, size, CRC), the kind, every length
    against ``limits``, and id, subject and tags as UTF-8 text without control
    characters; with ``now_ms`` also that ``deliver_at`` is at most
    ``limits.horizon_ms`` ahead. Properties and body are not decoded, unless
    ``check_properties`` asks for the properties to be checked too. Raises
    ``RemoteProtocolError`` naming the record's ``index``, the field and the
    limit; a batch that passes can be appended to a log as it is.
    """
    data = buf if type(buf) is bytes else bytes(buf)
    max_deliver_at = I64_MAX if now_ms is None else now_ms + limits.horizon_ms
    columns = scan_records(data, 0, len(data), limits, max_deliver_at, [] if check_properties else None, None)
    return MessageBatch(data, *columns)


def scan_records(
    data: bytes,
    start: int,
    stop: int,
    limits: CodecLimits,
    max_deliver_at: int,
    properties_out: list[dict[str, Any]] | None,
    count: int | None,
) -> Columns:
    """The one validator of message records: the columns of up to ``count`` records of ``data[start:stop]``.

    Every rule is checked for each record, in a fixed order (envelope, kind,
    layout, limits, contents); a record that breaks one is refused by
    ``delaymq.protocol.refusals``, which names the first rule broken. With
    ``properties_out`` the properties are checked too, and appended to it.
    """
    columns: Columns = ([], [], [], [], [], [], [], [])
    starts, ends, ids, subjects, tag_lists, deliver_ats, created_ats, attempt_counts = columns
    unpack, crc32, control, view = RECORD_HEADER.unpack_from, zlib.crc32, CONTROL.search, memoryview(data)
    max_payload, max_id, max_subject, max_tag = limits.max_record, limits.max_id, limits.max_subject, limits.max_tag
    max_tags, max_props, max_body = limits.max_tags, limits.max_properties, limits.max_body
    header_size, fixed = RECORD_HEADER_SIZE, MESSAGE_HEADER_SIZE
    pos = start
    index = 0
    # The hot loop of every server, run per record of every SEND: its checks stay inline, since
    # a function call per record costs about 6% of scan_batch here; only refusals call out.
    while pos < stop and index != count:
        (
            size,
            magic,
            version,
            kind,
            crc,
            deliver_at,
            created_at,
            attempts,
            id_len,
            subject_len,
            tag_count,
            flags,
            tags_len,
            props_len,
            body_len,
        ) = unpack(data, pos) if stop - pos >= header_size else short_header(data, pos, stop)
        end = pos + 12 + size
        if (
            magic != MAGIC
            or version != VERSION
            or size > max_payload
            or end > stop
            # Slicing bytes copies; a memoryview slice costs more to make
            # but nothing per byte, so big records are checked through one.
            or crc32((data if size < 4096 else view)[pos + 12 : end], crc32(data[pos : pos + 8])) != crc
        ):
            raise envelope_refusal(data, pos, stop, index, max_payload)
        if (
            kind != MESSAGE_KIND
            or flags
            or size != fixed + id_len + subject_len + tags_len + props_len + body_len
            or not 0 < id_len <= max_id
            or not 0 < subject_len <= max_subject
            or tag_count > max_tags
            or props_len > max_props
            or body_len > max_body
            or deliver_at > max_deliver_at
        ):
            raise header_refusal(data, pos, stop, index, limits, max_deliver_at)
        id_start = pos + header_size
        subject_start = id_start + id_len
        tags_start = subject_start + subject_len
        try:
            message_id = data[id_start:subject_start].decode()
            subject = data[subject_start:tags_start].decode()
        except UnicodeDecodeError:
            raise text_refusal(data, pos, index) from None
        # isprintable is a fast first check, true for most ids and subjects; the regex settles the rest.
        if not (message_id.isprintable() and subject.isprintable()) and (control(message_id) or control(subject)):
            raise text_refusal(data, pos, index)
        if tag_count or tags_len:
            tags = _scan_tags(data, tags_start, tags_start + tags_len, tag_count, max_tag, index, pos)
        else:
            tags = ()
        if properties_out is not None:
            properties_out.append(
                _scan_properties(data, tags_start + tags_len, props_len, index, pos) if props_len else {}
            )
        starts.append(pos)
        ends.append(end)
        ids.append(message_id)
        subjects.append(subject)
        tag_lists.append(tags)
        deliver_ats.append(deliver_at)
        created_ats.append(created_at)
        attempt_counts.append(attempts)
        pos = end
        index += 1
    return columns


def _scan_tags(
    data: bytes, pos: int, stop: int, count: int, max_tag: int, index: int, record_pos: int
) -> tuple[str, ...]:
    """The tags of record ``index`` (at ``record_pos``), from its tag section ``data[pos:stop]``."""
    start = pos
    tags = []
    control = CONTROL.search
    for number in range(count):
        if pos >= stop:
            raise refusal(index, record_pos, f"tag section ends before tag {number} of {count}", "bad_record", "tags")
        length = data[pos]
        pos += 1
        if pos + length > stop:
            raise refusal(index, record_pos, f"tag {number} runs past the tag section", "bad_record", "tags")
        if not 0 < length <= max_tag:
            text = f"tag {number} is {length} UTF-8 bytes, must be 1 to {max_tag}"
            raise refusal(index, record_pos, text, "limit", "tag", max_tag)
        try:
            tag = data[pos : pos + length].decode()
        except UnicodeDecodeError as error:
            raise refusal(index, record_pos, f"tag {number} {not_utf8(error)}", "bad_value", "tag") from None
        if not tag.isprintable() and control(tag):
            raise refusal(index, record_pos, f"tag {number} {tag!r} holds a control character", "bad_value", "tag")
        tags.append(tag)
        pos += length
    if pos != stop:
        text = f"tag section is {stop - start} bytes but its {count} tags use {pos - start}"
        raise refusal(index, record_pos, text, "bad_record", "tags")
    return tuple(tags)


def _scan_properties(data: bytes, pos: int, length: int, index: int, record_pos: int) -> dict[str, Any]:
    """The checked properties of record ``index`` (at ``record_pos``), from ``data[pos:pos + length]``."""
    try:
        return decode_properties(data[pos : pos + length])
    except ValueError as error:
        raise refusal(index, record_pos, str(error), "bad_value", "properties") from None


__all__ = ["Columns", "MessageBatch", "MessageHeader", "scan_batch", "scan_records"]
