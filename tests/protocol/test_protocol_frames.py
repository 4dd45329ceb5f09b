"""Frames: round trips, chunked input, and every way a byte stream can be bad."""

from __future__ import annotations

import struct

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from delaymq.net.limits import Limits
from delaymq.protocol import (
    FRAME_HEADER_SIZE,
    Command,
    Frame,
    FrameDecoder,
    FrameKind,
    LocalProtocolError,
    Message,
    PeerError,
    RemoteProtocolError,
    command_name,
    encode_batch,
    encode_frame,
    error_response,
    oneway,
    request,
    response_error,
    response_to,
    scan_batch,
)
from delaymq.protocol.errors import CODES

metadata_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(1 << 63), (1 << 64) - 1),
        st.floats(allow_nan=False),
        st.text(max_size=20),
        st.binary(max_size=20),
    ),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=10,
)

frames = st.builds(
    Frame,
    st.sampled_from(FrameKind),
    st.integers(0, 0xFFFF),
    st.integers(0, 0xFFFF_FFFF),
    st.dictionaries(st.text(max_size=10), metadata_values, max_size=5),
    st.binary(max_size=500),
)


def header(
    *,
    magic: bytes = b"DQ",
    version: int = 1,
    kind: int = 0,
    command: int = 1,
    request_id: int = 7,
    metadata_length: int = 0,
    body_length: int = 0,
) -> bytes:
    return struct.pack(">2sBBHIII", magic, version, kind, command, request_id, metadata_length, body_length)


def decode_all(decoder: FrameDecoder) -> list[Frame]:
    return list(decoder)


# ----------------------------------------------------------------- round trips


@given(frames)
def test_a_frame_survives_encode_and_decode(frame: Frame) -> None:
    decoder = FrameDecoder()
    decoder.feed(encode_frame(frame))
    assert decoder.next_frame() == frame
    assert decoder.next_frame() is None
    assert decoder.pending == 0
    decoder.end_of_stream()


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(frames, max_size=6), st.data())
def test_chunking_does_not_change_the_frames(sent: list[Frame], data: st.DataObject) -> None:
    stream = b"".join(encode_frame(frame) for frame in sent)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=10)))
    chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]

    in_chunks = FrameDecoder()
    received: list[Frame] = []
    for chunk in chunks:
        in_chunks.feed(chunk)
        received.extend(in_chunks)
    assert received == sent
    in_chunks.end_of_stream()

    byte_by_byte = FrameDecoder()
    received = []
    for offset in range(len(stream)):
        byte_by_byte.feed(stream[offset : offset + 1])
        received.extend(byte_by_byte)
    assert received == sent


def test_many_frames_through_one_decoder_keep_the_buffer_small() -> None:
    """The decoder consumes by position and compacts, so a long stream neither
    loses frames nor piles up consumed bytes."""
    decoder = FrameDecoder()
    body = bytes(range(256)) * 40
    frame_bytes = encode_frame(request(Command.SEND, 0, {"n": 0}, body))
    pieces = [encode_frame(request(Command.SEND, n, {"n": n}, body)) for n in range(300)]
    stream = b"".join(pieces)
    seen = []
    step = len(frame_bytes) * 3 // 2 + 1  # never aligned with frame ends
    for offset in range(0, len(stream), step):
        decoder.feed(stream[offset : offset + step])
        seen.extend(frame.request_id for frame in decoder)
        assert decoder.pending < 2 * step
        assert len(decoder._buf) < 128 * 1024 + 2 * step  # consumed bytes get dropped
    assert seen == list(range(300))


def test_a_frame_carries_a_record_batch_untouched() -> None:
    batch = encode_batch([Message(f"m{n}", "orders", body=b"x" * n) for n in range(10)])
    decoder = FrameDecoder()
    decoder.feed(encode_frame(request(Command.SCHEDULE, 3, {"producer": "p1"}, batch)))
    frame = decoder.next_frame()
    assert frame is not None and frame.body == batch
    assert scan_batch(frame.body).ids == [f"m{n}" for n in range(10)]


def test_empty_metadata_takes_no_bytes() -> None:
    data = encode_frame(request(Command.PING, 1))
    assert len(data) == FRAME_HEADER_SIZE
    decoder = FrameDecoder()
    decoder.feed(header(metadata_length=1) + b"\x80")  # an explicit empty map is fine too
    assert decoder.next_frame() == Frame(FrameKind.REQUEST, 1, 7, {}, b"")


def test_unknown_commands_decode_as_plain_ints() -> None:
    decoder = FrameDecoder()
    decoder.feed(encode_frame(request(999, 5, {"x": 1})))
    frame = decoder.next_frame()
    assert frame is not None and frame.command == 999
    assert command_name(999) == "UNKNOWN(999)"
    assert command_name(Command.SCHEDULE) == "SCHEDULE"


def test_frame_at_the_limit_passes_and_one_byte_more_fails() -> None:
    limits = Limits(max_frame=1000)
    at_limit = request(Command.SEND, 1, {}, bytes(1000 - FRAME_HEADER_SIZE))
    decoder = FrameDecoder(limits)
    decoder.feed(encode_frame(at_limit, limits))
    assert decoder.next_frame() == at_limit
    with pytest.raises(LocalProtocolError) as info:
        encode_frame(request(Command.SEND, 1, {}, bytes(1001 - FRAME_HEADER_SIZE)), limits)
    assert (info.value.code, info.value.field, info.value.limit) == ("oversize", "frame", 1000)
    assert "1000" in str(info.value)


# ------------------------------------------------------------ helpers, errors


def test_request_response_and_error_helpers() -> None:
    ask = request(Command.PULL, 42, {"group": "g"})
    assert (ask.kind, ask.command, ask.request_id) == (FrameKind.REQUEST, Command.PULL, 42)
    answer = response_to(ask, {"count": 0}, b"")
    assert (answer.kind, answer.command, answer.request_id) == (FrameKind.RESPONSE, Command.PULL, 42)
    assert response_error(answer) is None
    assert response_error(ask) is None
    assert oneway(Command.HEARTBEAT, {"tick": 5}).kind == FrameKind.ONEWAY

    refused = RemoteProtocolError(
        "record 3: subject is 300 UTF-8 bytes, must be 1 to 255",
        code="limit",
        field="subject",
        limit=255,
        index=3,
    )
    for origin in (ask, (Command.PULL, 42)):
        reply = error_response(origin, refused)
        assert reply.metadata == {"error": refused.to_dict()}
        decoder = FrameDecoder()
        decoder.feed(encode_frame(reply))
        received = decoder.next_frame()
        assert received is not None
        error = response_error(received)
        assert isinstance(error, PeerError)
        assert (error.code, error.field, error.limit, error.index) == ("limit", "subject", 255, 3)
        assert (error.request_id, error.command) == (42, Command.PULL)
        assert str(error) == str(refused)


def test_a_malformed_error_answer_is_the_peer_s_fault() -> None:
    reply = Frame(FrameKind.RESPONSE, 1, 1, {"error": {"message": "no code"}})
    with pytest.raises(RemoteProtocolError) as info:
        response_error(reply)
    assert (info.value.code, info.value.field) == ("bad_metadata", "error.code")
    with pytest.raises(RemoteProtocolError):
        response_error(Frame(FrameKind.RESPONSE, 1, 1, {"error": "boom"}))


@pytest.mark.parametrize(
    ("frame", "code", "field"),
    [
        (Frame(FrameKind.REQUEST, 1 << 16, 1), "bad_frame", "command"),
        (Frame(FrameKind.REQUEST, 1, 1 << 32), "bad_frame", "request_id"),
        (Frame(FrameKind.REQUEST, 1, -1), "bad_frame", "request_id"),
        (Frame(7, 1, 1), "bad_frame", "kind"),  # type: ignore[arg-type]
        (Frame(FrameKind.REQUEST, 1, 1, {"x": object()}), "bad_metadata", "metadata"),
        (Frame(FrameKind.REQUEST, 1, 1, {1: "x"}), "bad_metadata", "metadata"),  # type: ignore[dict-item]
        (Frame(FrameKind.REQUEST, 1, 1, ["x"]), "bad_metadata", "metadata"),  # type: ignore[arg-type]
        (Frame(FrameKind.REQUEST, 1, 1, {}, "text"), "bad_frame", "body"),  # type: ignore[arg-type]
    ],
)
def test_encode_refuses_bad_frames(frame: Frame, code: str, field: str) -> None:
    with pytest.raises(LocalProtocolError) as info:
        encode_frame(frame)
    assert (info.value.code, info.value.field) == (code, field)


@pytest.mark.parametrize(
    ("data", "code", "field"),
    [
        (b"HTTP/1.1 200 OK\r\n", "bad_magic", "magic"),
        (b"X", "bad_magic", "magic"),  # caught on the first byte
        (header(version=2), "unknown_version", "version"),
        (header(version=0), "unknown_version", "version"),
    ],
)
def test_fatal_stream_errors(data: bytes, code: str, field: str) -> None:
    decoder = FrameDecoder()
    decoder.feed(data)
    with pytest.raises(RemoteProtocolError) as info:
        decoder.next_frame()
    assert (info.value.code, info.value.field, info.value.fatal) == (code, field, True)
    # The stream cannot be trusted any more: the decoder refuses further use.
    with pytest.raises(RemoteProtocolError) as again:
        decoder.feed(encode_frame(request(Command.PING, 1)))
    assert again.value.fatal and again.value.code == code
    with pytest.raises(RemoteProtocolError):
        decoder.next_frame()


def test_an_oversize_header_is_fatal_before_its_body_arrives() -> None:
    decoder = FrameDecoder(Limits(max_frame=1024))
    decoder.feed(header(command=Command.SEND, request_id=9, body_length=1024 - FRAME_HEADER_SIZE + 1))
    with pytest.raises(RemoteProtocolError) as info:
        decoder.next_frame()
    error = info.value
    assert (error.code, error.field, error.limit, error.fatal) == ("oversize", "frame", 1024, True)
    assert (error.request_id, error.command) == (9, Command.SEND)  # so it can be answered
    assert "1024" in str(error)
    # The default limit, 64 MiB, against a header announcing 4 GiB.
    default = FrameDecoder()
    default.feed(header(metadata_length=0xFFFF_FFFF, body_length=0xFFFF_FFFF))
    with pytest.raises(RemoteProtocolError) as info:
        default.next_frame()
    assert (info.value.code, info.value.limit) == ("oversize", 64 * 1024 * 1024)


@pytest.mark.parametrize(
    "metadata",
    [
        msgpack.packb([1, 2]),  # not a map
        msgpack.packb("text"),
        msgpack.packb({1: "int key"}),
        b"\xc1",  # never valid msgpack
        b"\x82\xa1a",  # a map cut short
        msgpack.packb({"a": 1}) + b"\x00",  # trailing bytes
    ],
)
def test_bad_metadata_skips_the_frame_and_keeps_the_stream(metadata: bytes) -> None:
    decoder = FrameDecoder()
    follow_up = request(Command.PING, 8, {"ok": True})
    decoder.feed(
        header(command=Command.ROUTE, request_id=7, metadata_length=len(metadata), body_length=3)
        + metadata
        + b"abc"
        + encode_frame(follow_up)
    )
    with pytest.raises(RemoteProtocolError) as info:
        decoder.next_frame()
    error = info.value
    assert (error.code, error.field, error.fatal) == ("bad_metadata", "metadata", False)
    assert (error.request_id, error.command) == (7, Command.ROUTE)
    assert error_response(error, error).request_id == 7  # the server answers it...
    assert decoder.next_frame() == follow_up  # ...and carries on


def test_an_unknown_frame_kind_is_skipped_not_fatal() -> None:
    decoder = FrameDecoder()
    decoder.feed(header(kind=9, request_id=3) + encode_frame(request(Command.PING, 4)))
    with pytest.raises(RemoteProtocolError) as info:
        decoder.next_frame()
    assert (info.value.code, info.value.field, info.value.fatal, info.value.request_id) == (
        "bad_frame",
        "kind",
        False,
        3,
    )
    frame = decoder.next_frame()
    assert frame is not None and frame.request_id == 4


@pytest.mark.parametrize("cut", [1, 5, FRAME_HEADER_SIZE, FRAME_HEADER_SIZE + 3, -1])
def test_a_stream_that_stops_inside_a_frame_is_truncated(cut: int) -> None:
    data = encode_frame(request(Command.SEND, 1, {"k": "v"}, b"body"))
    decoder = FrameDecoder()
    decoder.feed(data + data[:cut])
    assert decoder.next_frame() is not None
    assert decoder.next_frame() is None  # just waiting for more bytes
    with pytest.raises(RemoteProtocolError) as info:
        decoder.end_of_stream()
    assert (info.value.code, info.value.fatal) == ("truncated", True)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(
    prefix=st.sampled_from([b"", b"DQ", b"DQ\x01", b"DQ\x01\x00"]),
    data=st.binary(max_size=300),
    chunk=st.integers(1, 64),
)
def test_random_bytes_only_ever_raise_protocol_errors_and_never_hang(prefix: bytes, data: bytes, chunk: int) -> None:
    stream = prefix + data
    decoder = FrameDecoder(Limits(max_frame=4096))
    calls = 0
    try:
        for offset in range(0, len(stream), chunk):
            decoder.feed(stream[offset : offset + chunk])
            while True:
                calls += 1
                assert calls <= len(stream) + 2 * (len(stream) // chunk + 1)  # bounded work
                try:
                    if decoder.next_frame() is None:
                        break
                except RemoteProtocolError as error:
                    assert error.code in CODES
                    if error.fatal:
                        raise
        decoder.end_of_stream()
    except RemoteProtocolError as error:
        assert error.code in CODES and error.fatal
