"""Message records: round trips, the server-side scan, and every refusal."""

from __future__ import annotations

import os
import struct
import zlib

import msgpack
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from delaymq.net.limits import DEFAULT_LIMITS, Limits
from delaymq.protocol import (
    LocalProtocolError,
    Message,
    MessageHeader,
    RemoteProtocolError,
    decode_batch,
    decode_message,
    encode_batch,
    encode_message,
    new_message_id,
    rewrite_delivery,
    scan_batch,
    tag_bit,
    tags_mask,
)
from delaymq.protocol.envelope import RecordKind, encode, iter_spans, valid_prefix
from delaymq.protocol.errors import CODES
from delaymq.protocol.records import MAX_ATTEMPTS, RECORD_TIMES, raise_attempts, record_subject

I64 = st.integers(-(1 << 63), (1 << 63) - 1)
MiB = 1024 * 1024


def text_within(max_bytes: int) -> st.SearchStrategy[str]:
    """Non-empty text without control characters, at most ``max_bytes`` of UTF-8."""
    return (
        st.text(st.characters(exclude_categories=("Cc", "Cs")), min_size=1, max_size=max_bytes)
        .map(lambda s: s.encode()[:max_bytes].decode(errors="ignore"))
        .filter(bool)
    )


property_values = st.one_of(
    st.text(max_size=20),
    st.integers(-(1 << 63), (1 << 64) - 1),
    st.floats(allow_nan=False),
    st.booleans(),
    st.binary(max_size=20),
)

messages = st.builds(
    Message,
    text_within(DEFAULT_LIMITS.max_id),
    text_within(DEFAULT_LIMITS.max_subject),
    tags=st.lists(text_within(DEFAULT_LIMITS.max_tag), max_size=DEFAULT_LIMITS.max_tags).map(tuple),
    properties=st.dictionaries(st.text(max_size=10), property_values, max_size=5),
    body=st.binary(max_size=300),
    deliver_at=I64,
    created_at=I64,
    attempts=st.integers(0, 0xFFFF),
)


def raw_record(
    *,
    kind: int = RecordKind.MESSAGE,
    deliver_at: int = 0,
    created_at: int = 0,
    attempts: int = 0,
    id: bytes = b"m1",
    subject: bytes = b"orders",
    tags: list[bytes] = (),  # type: ignore[assignment]
    props: bytes = b"",
    body: bytes = b"",
    flags: int = 0,
    tag_count: int | None = None,
    **length_overrides: int,
) -> bytes:
    """A record with a valid envelope (so the CRC checks) and any field values,
    even ones the encoder refuses: what a broken or hostile peer could send."""
    tag_section = b"".join(len(t).to_bytes(1, "big") + t for t in tags)
    lengths = {
        "id_len": len(id),
        "subject_len": len(subject),
        "tags_len": len(tag_section),
        "props_len": len(props),
        "body_len": len(body),
    } | length_overrides
    header = struct.pack(
        ">qqHHHBBHII",
        deliver_at,
        created_at,
        attempts,
        lengths["id_len"],
        lengths["subject_len"],
        len(tags) if tag_count is None else tag_count,
        flags,
        lengths["tags_len"],
        lengths["props_len"],
        lengths["body_len"],
    )
    return encode(kind, header + id + subject + tag_section + props + body)


def refusal(buf: bytes, limits: Limits = DEFAULT_LIMITS, **kwargs: object) -> RemoteProtocolError:
    with pytest.raises(RemoteProtocolError) as info:
        scan_batch(buf, limits, **kwargs)  # type: ignore[arg-type]
    return info.value


# ----------------------------------------------------------------- round trips


@given(messages)
def test_a_message_survives_encode_and_decode(message: Message) -> None:
    record = message.encode()
    assert decode_message(record) == message
    assert decode_message(b"junk" + record + b"more", 4) == message
    assert decode_message(bytearray(record)) == message


@given(st.lists(messages, max_size=8))
def test_scan_agrees_with_full_decode(batch: list[Message]) -> None:
    buf = encode_batch(batch)
    scanned = scan_batch(buf, check_properties=True)
    decoded = decode_batch(buf)
    assert decoded == batch
    assert len(scanned) == len(batch)
    for header, message in zip(scanned, decoded, strict=True):
        assert (header.id, header.subject, header.tags) == (message.id, message.subject, message.tags)
        assert (header.deliver_at, header.created_at, header.attempts) == (
            message.deliver_at,
            message.created_at,
            message.attempts,
        )
        assert decode_message(buf[header.start : header.end]) == message
    # The spans are the envelope's spans: a server appends ``buf`` as it is.
    assert [(h.start, h.end) for h in scanned] == [(s.start, s.end) for s in iter_spans(buf)]
    assert scanned.buf == buf


def test_batch_columns_and_headers_say_the_same() -> None:
    first = Message("a", "s", tags=("x",), deliver_at=5, created_at=1, attempts=2)
    second = Message("b", "t", body=b"xyz")
    buf = encode_batch([first, second])
    batch = scan_batch(memoryview(buf))
    assert batch.ids == ["a", "b"]
    assert batch.subjects == ["s", "t"]
    assert batch.tags == [("x",), ()]
    assert batch.deliver_ats == [5, 0]
    assert batch.created_ats == [1, 0]
    assert batch.attempts == [2, 0]
    assert batch[1] == MessageHeader(batch.starts[1], len(buf), "b", "t", (), 0, 0, 0)
    assert batch.record(0) == first.encode()
    assert batch.record(1) == second.encode()


def test_an_empty_batch_scans_to_nothing() -> None:
    assert len(scan_batch(b"")) == 0
    assert decode_batch(b"") == []


def test_encode_message_is_message_encode() -> None:
    record = encode_message("id-1", "subj", tags=["a", "b"], properties={"k": "v"}, body=b"b")
    assert record == Message("id-1", "subj", tags=("a", "b"), properties={"k": "v"}, body=b"b").encode()
    assert decode_message(record).tags == ("a", "b")


def test_message_at_every_limit_round_trips() -> None:
    message = Message(
        "i" * 64,
        "é" * 127 + "s",  # 255 UTF-8 bytes
        tags=tuple(f"{n:02d}" + "t" * 62 for n in range(16)),
        properties={"p": b"x" * (64 * 1024 - 16)},
        body=b"\xff" * (4 * MiB),
    )
    assert len(msgpack.packb(message.properties)) <= 64 * 1024
    assert decode_batch(encode_batch([message, message])) == [message, message]


def test_a_raised_body_limit_carries_big_bodies() -> None:
    limits = Limits(max_body=8 * MiB, max_frame=16 * MiB)
    message = Message("big", "s", body=bytes(range(256)) * (8 * MiB // 256))
    record = message.encode(limits)
    assert decode_message(record, limits=limits) == message
    error = refusal(record)  # the default limits refuse it on the way in
    assert (error.code, error.field, error.limit) == ("oversize", "record", DEFAULT_LIMITS.max_record)
    with pytest.raises(LocalProtocolError) as info:
        message.encode()
    assert (info.value.code, info.value.field, info.value.limit) == ("limit", "body", 4 * MiB)


def test_a_record_at_every_limit_is_exactly_max_record_and_one_more_byte_is_oversize() -> None:
    limits = Limits(max_id=3, max_subject=4, max_tags=2, max_tag=3, max_properties=5, max_body=6)
    tags = [b"abc", b"def"]
    record = raw_record(id=b"abc", subject=b"abcd", tags=tags, props=b"p" * 5, body=b"b" * 6)
    (payload_size,) = struct.unpack_from(">I", record)
    assert payload_size == limits.max_record
    assert scan_batch(record, limits).ids == ["abc"]
    error = refusal(raw_record(id=b"abc", subject=b"abcd", tags=tags, props=b"p" * 5, body=b"b" * 7), limits)
    assert (error.code, error.field, error.limit) == ("oversize", "record", limits.max_record)


def test_tags_given_as_a_list_become_a_tuple() -> None:
    assert Message("a", "s", tags=["x", "y"]).tags == ("x", "y")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Message("a", "s", tags="xy")  # type: ignore[arg-type]


# ---------------------------------------------------------- refusing to send


@pytest.mark.parametrize(
    ("kwargs", "code", "field", "limit"),
    [
        ({"id": ""}, "limit", "id", 64),
        ({"id": "x" * 65}, "limit", "id", 64),
        ({"id": "é" * 33}, "limit", "id", 64),  # 33 characters, 66 bytes
        ({"id": "a\nb"}, "bad_value", "id", None),
        ({"id": "a\x85b"}, "bad_value", "id", None),  # a C1 control
        ({"id": "\ud800"}, "bad_value", "id", None),  # a lone surrogate
        ({"id": 5}, "bad_value", "id", None),
        ({"subject": ""}, "limit", "subject", 255),
        ({"subject": "s" * 256}, "limit", "subject", 255),
        ({"subject": "a\x7f"}, "bad_value", "subject", None),
        ({"tags": ("t",) * 17}, "limit", "tags", 16),
        ({"tags": ("",)}, "limit", "tag", 64),
        ({"tags": ("t" * 65,)}, "limit", "tag", 64),
        ({"tags": ("a\tb",)}, "bad_value", "tag", None),
        ({"tags": "abc"}, "bad_value", "tags", None),
        ({"properties": {"p": "x" * (64 * 1024)}}, "limit", "properties", 64 * 1024),
        ({"properties": {1: "x"}}, "bad_value", "properties", None),
        ({"properties": {"p": [1, 2]}}, "bad_value", "properties", None),
        ({"properties": {"p": None}}, "bad_value", "properties", None),
        ({"properties": {"p": 1 << 64}}, "bad_value", "properties", None),
        ({"properties": ["p"]}, "bad_value", "properties", None),
        ({"body": b"x" * (4 * MiB + 1)}, "limit", "body", 4 * MiB),
        ({"body": "text"}, "bad_value", "body", None),
        ({"deliver_at": 1 << 63}, "limit", "deliver_at", (1 << 63) - 1),
        ({"created_at": -(1 << 63) - 1}, "limit", "created_at", (1 << 63) - 1),
        ({"attempts": 0x10000}, "limit", "attempts", 0xFFFF),
        ({"attempts": -1}, "limit", "attempts", 0xFFFF),
        ({"deliver_at": 1.5}, "bad_value", "deliver_at", None),
    ],
)
def test_encode_refuses_each_broken_limit(kwargs: dict, code: str, field: str, limit: int | None) -> None:
    fields = {"id": "m1", "subject": "orders"} | kwargs
    with pytest.raises(LocalProtocolError) as info:
        encode_message(fields.pop("id"), fields.pop("subject"), **fields)
    error = info.value
    assert (error.code, error.field, error.limit) == (code, field, limit)
    assert field in str(error)
    if limit is not None:
        assert str(limit) in str(error)


def test_encode_obeys_configured_limits() -> None:
    limits = Limits(max_subject=4, max_tags=1)
    assert decode_message(encode_message("a", "abcd", tags=["t"], limits=limits), limits=limits).subject == "abcd"
    with pytest.raises(LocalProtocolError) as info:
        encode_message("a", "abcde", limits=limits)
    assert (info.value.field, info.value.limit) == ("subject", 4)
    with pytest.raises(LocalProtocolError) as info:
        encode_message("a", "abcd", tags=["t", "u"], limits=limits)
    assert (info.value.field, info.value.limit) == ("tags", 1)


# ---------------------------------------------------------- refusing to accept


@pytest.mark.parametrize(
    ("record", "code", "field", "limit"),
    [
        (raw_record(id=b""), "limit", "id", 64),
        (raw_record(id=b"x" * 65), "limit", "id", 64),
        (raw_record(id=b"a\x00b"), "bad_value", "id", None),
        (raw_record(id=b"\xc2\x9f"), "bad_value", "id", None),  # U+009F, a C1 control
        (raw_record(id=b"\xff\xfe"), "bad_value", "id", None),  # not UTF-8
        (raw_record(subject=b""), "limit", "subject", 255),
        (raw_record(subject=b"s" * 256), "limit", "subject", 255),
        (raw_record(subject=b"\xe2\x82"), "bad_value", "subject", None),  # cut UTF-8
        (raw_record(subject=b"a\x1bb"), "bad_value", "subject", None),
        (raw_record(tags=[b"t"] * 17), "limit", "tags", 16),
        (raw_record(tags=[b""]), "limit", "tag", 64),
        (raw_record(tags=[b"ok", b"t" * 65]), "limit", "tag", 64),
        (raw_record(tags=[b"\x01"]), "bad_value", "tag", None),
        (raw_record(tags=[b"\xc3"]), "bad_value", "tag", None),
        (raw_record(tags=[b"a", b"b"], tag_count=1), "bad_record", "tags", None),
        (raw_record(tags=[b"a"], tag_count=2), "bad_record", "tags", None),
        (raw_record(props=b"\x81" + b"\xa1p" + b"\xa1v" + b"x" * (64 * 1024)), "limit", "properties", 64 * 1024),
        (raw_record(body=b"x" * (4 * MiB + 1)), "limit", "body", 4 * MiB),
        (raw_record(kind=RecordKind.DISPATCH), "bad_record", "kind", None),
        (raw_record(flags=1), "bad_record", "flags", None),
        (raw_record(body=b"abc", body_len=2), "bad_record", "lengths", None),
        (raw_record(body=b"abc", body_len=4), "bad_record", "lengths", None),
        (encode(RecordKind.MESSAGE, b"short"), "bad_record", "header", None),
    ],
)
def test_scan_refuses_each_broken_field(record: bytes, code: str, field: str, limit: int | None) -> None:
    good = raw_record()
    error = refusal(good + good + record + good)
    assert (error.code, error.field, error.limit, error.index) == (code, field, limit, 2)
    assert error.fatal is False
    assert "record 2" in str(error)
    if limit is not None:
        assert str(limit) in str(error)
    with pytest.raises(RemoteProtocolError) as info:
        decode_batch(good + record)
    assert (info.value.code, info.value.field, info.value.index) == (code, field, 1)


@pytest.mark.parametrize(
    "props",
    [
        b"\xc1",  # never valid msgpack
        b"\x92\x01\x02",  # an array, not a map
        b"\x81\x01\xa1v",  # an int key
        b"\x81\xa1p\xc0",  # a nil value
        b"\x81\xa1p\x91\x01",  # a list value
        b"\x81\xa1p\xa1v\x00",  # trailing bytes
    ],
)
def test_bad_properties_are_refused_when_decoded(props: bytes) -> None:
    record = raw_record(props=props)
    scan_batch(record)  # the header scan does not look inside properties
    error = refusal(record, check_properties=True)
    assert (error.code, error.field, error.index) == ("bad_value", "properties", 0)
    with pytest.raises(RemoteProtocolError) as info:
        decode_message(record)
    assert (info.value.code, info.value.field) == ("bad_value", "properties")


def test_scan_checks_the_horizon_when_given_now() -> None:
    now = 1_767_225_600_000
    limits = Limits(horizon_ms=1000)
    at_horizon = raw_record(deliver_at=now + 1000)
    beyond = raw_record(deliver_at=now + 1001)
    assert scan_batch(at_horizon + beyond, limits).deliver_ats == [now + 1000, now + 1001]
    scan_batch(at_horizon, limits, now_ms=now)
    error = refusal(at_horizon + beyond, limits, now_ms=now)
    assert (error.code, error.field, error.limit, error.index) == ("limit", "deliver_at", 1000, 1)
    assert scan_batch(raw_record(deliver_at=0), limits, now_ms=now).deliver_ats == [0]


def test_scan_obeys_configured_limits() -> None:
    record = raw_record(subject=b"abcde")
    error = refusal(record, Limits(max_subject=4))
    assert (error.code, error.field, error.limit) == ("limit", "subject", 4)


def test_envelope_damage_is_named() -> None:
    good = raw_record(body=b"payload")
    flipped = bytearray(good)
    flipped[-1] ^= 1
    bad_magic = bytearray(good)
    bad_magic[4] = 0x00
    bad_version = bytearray(good)
    bad_version[5] = 9
    cases = {
        "bad_crc": bytes(flipped),
        "bad_magic": bytes(bad_magic),
        "unknown_version": bytes(bad_version),
        "truncated": good[:-1],
    }
    for code, damaged in cases.items():
        error = refusal(good + damaged)
        assert (error.code, error.index) == (code, 1), code
    assert refusal(good[:5]).code == "truncated"  # inside the envelope header
    assert refusal(good[:30]).code == "truncated"  # inside the message header
    oversize = struct.pack(">IBBHI", 1 << 30, 0xD7, 1, 1, 0)
    error = refusal(oversize + bytes(40))
    assert (error.code, error.field, error.limit) == ("oversize", "record", DEFAULT_LIMITS.max_record)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=400))
def test_random_bytes_only_ever_raise_remote_protocol_errors(data: bytes) -> None:
    for attempt in (lambda: scan_batch(data), lambda: decode_batch(data), lambda: decode_message(data)):
        try:
            attempt()
        except RemoteProtocolError as error:
            assert error.code in CODES


_valid_bytes = text_within(64).map(str.encode)
field_bytes = st.one_of(  # mostly valid, so that deeper checks are reached
    _valid_bytes,
    _valid_bytes,
    _valid_bytes,
    _valid_bytes,
    st.binary(max_size=70),
    st.sampled_from([b"", b"\x00", b"\xc2\x85", b"x" * 65]),
)


@settings(max_examples=500, suppress_health_check=[HealthCheck.too_slow])
@given(
    id=field_bytes,
    subject=field_bytes,
    tags=st.one_of(st.lists(_valid_bytes, max_size=3), st.lists(field_bytes, max_size=18)),
    props=st.one_of(
        st.just(b""),
        st.dictionaries(st.text(max_size=5), property_values, max_size=3).map(msgpack.packb),
        st.binary(max_size=20),
    ),
    body=st.binary(max_size=50),
    kind=st.sampled_from([RecordKind.MESSAGE] * 9 + [RecordKind.STATE]),
    flags=st.sampled_from([0] * 9 + [4]),
    tag_count=st.one_of(st.none(), st.integers(0, 20)),
    length_overrides=st.dictionaries(
        st.sampled_from(["id_len", "subject_len", "tags_len", "props_len", "body_len"]),
        st.integers(0, 100),
        max_size=1,
    ),
)
def test_records_with_a_good_crc_are_judged_consistently(
    id: bytes,
    subject: bytes,
    tags: list[bytes],
    props: bytes,
    body: bytes,
    kind: int,
    flags: int,
    tag_count: int | None,
    length_overrides: dict[str, int],
) -> None:
    """Past the CRC, scanning and decoding judge every record alike: a refusal is
    a named RemoteProtocolError, an acceptance decodes and re-encodes to the same
    message."""
    tags = [t[:255] for t in tags]
    record = raw_record(
        kind=kind,
        id=id,
        subject=subject,
        tags=tags,
        props=props,
        body=body,
        flags=flags,
        tag_count=tag_count,
        **length_overrides,
    )
    try:
        batch = scan_batch(record, check_properties=True)
    except RemoteProtocolError as error:
        event(f"refused: {error.code} {error.field}")
        assert error.code in CODES and error.index == 0
        with pytest.raises(RemoteProtocolError) as info:
            decode_message(record)
        assert (info.value.code, info.value.field) == (error.code, error.field)
    else:
        event("accepted")
        [message] = decode_batch(record)
        assert (batch.ids[0], batch.subjects[0], batch.tags[0]) == (message.id, message.subject, message.tags)
        assert decode_message(message.encode()) == message
        if props == (msgpack.packb(message.properties) if message.properties else b""):
            assert message.encode() == record  # msgpack has more than one encoding of a map


@given(st.lists(messages, min_size=1, max_size=4), st.data())
def test_any_damage_to_a_batch_is_caught(batch: list[Message], data: st.DataObject) -> None:
    buf = bytearray(encode_batch(batch))
    position = data.draw(st.integers(0, len(buf) - 1))
    buf[position] ^= data.draw(st.integers(1, 255))
    error = refusal(bytes(buf))
    assert error.code in CODES
    # The scan stops at the record the envelope's recovery stops at.
    end, _reason = valid_prefix(buf)
    assert sum(1 for s in iter_spans(buf, 0, end)) == error.index


# -------------------------------------------------------------------- retries


@given(messages, I64, st.integers(0, 0xFFFF))
def test_rewrite_delivery_changes_only_delivery(message: Message, deliver_at: int, attempts: int) -> None:
    rewritten = rewrite_delivery(message.encode(), deliver_at=deliver_at, attempts=attempts)
    assert len(rewritten) == len(message.encode())
    assert list(iter_spans(rewritten))  # the CRC checks
    again = decode_message(rewritten)
    assert again.deliver_at == deliver_at and again.attempts == attempts
    assert again.id == message.id and again.created_at == message.created_at
    assert again.tags == message.tags and again.properties == message.properties
    assert again.body == message.body and again.subject == message.subject


def test_rewrite_delivery_refuses_what_is_not_one_intact_message() -> None:
    record = Message("a", "s", body=b"xyz").encode()
    damaged = bytearray(record)
    damaged[-1] ^= 1
    cases = {
        "bad_crc": bytes(damaged),
        "truncated": record[:-1],
        "bad_record": record + record,
    }
    for code, data in cases.items():
        with pytest.raises(RemoteProtocolError) as info:
            rewrite_delivery(data, deliver_at=1, attempts=1)
        assert info.value.code == code
    with pytest.raises(RemoteProtocolError) as info:
        rewrite_delivery(encode(RecordKind.DISPATCH, bytes(40)), deliver_at=1, attempts=1)
    assert (info.value.code, info.value.field) == ("bad_record", "kind")
    with pytest.raises(LocalProtocolError) as info:
        rewrite_delivery(record, deliver_at=1, attempts=1 << 16)
    assert (info.value.field, info.value.limit) == ("attempts", 0xFFFF)


# ------------------------------------------------------------ ids and tag bits


def test_tags_mask_sets_one_bit_per_tag() -> None:
    assert tags_mask([]) == 0
    assert tag_bit("red") == 1 << (zlib.crc32(b"red") % 64)
    assert tags_mask(["red", "blue"]) == tag_bit("red") | tag_bit("blue")
    assert tags_mask(["red", "red"]) == tag_bit("red")
    masks = [tags_mask([f"tag-{n}"]) for n in range(200)]
    assert all(mask and mask & (mask - 1) == 0 and mask < 1 << 64 for mask in masks)
    assert len(set(masks)) > 32  # the bits spread out


def test_message_ids_are_unique_and_time_ordered() -> None:
    ids = [new_message_id(1_767_225_600_000 + n // 10) for n in range(1000)]
    assert len(set(ids)) == 1000
    assert ids == sorted(ids)
    assert all(len(i) == 32 and int(i, 16) >= 0 and i == i.lower() for i in ids)
    assert ids[0].startswith(f"{1_767_225_600_000:012x}")
    random_ids = {new_message_id() for _ in range(100)}
    assert len(random_ids) == 100 and all(len(i) == 32 for i in random_ids)
    assert decode_message(Message(ids[0], "s").encode()).id == ids[0]


def test_a_forked_process_makes_ids_of_its_own_in_the_same_millisecond() -> None:
    """The random digits are drawn again in a forked child, and the digits the parent last
    made for this millisecond are not reused there."""
    at = 1_767_225_600_000
    parent = new_message_id(at)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one id, then out at once
        os.write(write_end, new_message_id(at).encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        child = pipe.read().decode()
    os.waitpid(pid, 0)
    assert child[:12] == parent[:12] == f"{at:012x}"
    assert child[12:22] != parent[12:22]  # another process: other random digits
    assert new_message_id(at)[:22] == parent[:22]  # the parent goes on with its own


def test_the_widest_tag_limits_the_layout_holds() -> None:
    limits = Limits(max_tags=255, max_tag=255)
    message = Message("a", "s", tags=tuple(f"{n:03d}" + "t" * 252 for n in range(255)))
    record = message.encode(limits)
    assert scan_batch(record, limits).tags == [message.tags]
    assert decode_message(record, limits=limits) == message


@given(
    id=st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=64),
    subject=st.text(st.characters(min_codepoint=48, max_codepoint=122), min_size=1, max_size=255),
    attempts=st.integers(0, 0xFFFF),
    by=st.integers(1, 0x1FFFF),
)
def test_record_readers_agree_with_the_decoder(id: str, subject: str, attempts: int, by: int) -> None:
    record = encode_message(id, subject, body=b"x", deliver_at=123, created_at=45, attempts=attempts)
    assert record_subject(record) == subject.encode()
    assert RECORD_TIMES.unpack_from(record)[-2:] == (123, 45)
    again = decode_message(raise_attempts(record, by))  # a fresh CRC: it decodes
    assert again.attempts == min(attempts + by, MAX_ATTEMPTS)
    assert (again.id, again.subject, again.deliver_at, again.body) == (id, subject, 123, b"x")
