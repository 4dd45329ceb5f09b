"""Frames: what travels over a connection, and a sans-IO decoder for them.

A frame is a fixed header, a msgpack metadata map and a body::

    offset size  field
    0      2     magic            b"DQ"
    2      1     version          1
    3      1     kind             u8   REQUEST=0, RESPONSE=1, ONEWAY=2
    4      2     command          u16  see ``delaymq.protocol.commands``
    6      4     request_id       u32  a response carries its request's id
    10     4     metadata_length  u32  0 means an empty map
    14     4     body_length      u32
    18     .     metadata         msgpack map with str keys
    .      .     body             bytes: usually a batch of message records

Integers are big-endian. The decoder is fed bytes and hands out frames, as h11
does for HTTP; the trio code around it does the reading and writing. An error
answer is a RESPONSE whose metadata is ``{"error": ProtocolError.to_dict()}``.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgpack

from delaymq.protocol.commands import command_name
from delaymq.protocol.errors import (
    LocalProtocolError,
    PeerError,
    ProtocolError,
    RemoteProtocolError,
)
from delaymq.protocol.limits import DEFAULT_CODEC_LIMITS, MAX_METADATA_DEPTH, MAX_METADATA_ITEMS, CodecLimits
from delaymq.protocol.shape import shape_problem

MAGIC = b"DQ"
VERSION = 1
FRAME_HEADER = struct.Struct(">2sBBHIII")
FRAME_HEADER_SIZE = FRAME_HEADER.size  # 18

_U16 = 0xFFFF
_U32 = 0xFFFF_FFFF
# Compact the decoder's buffer once this many consumed bytes sit at its front.
_COMPACT_AT = 64 * 1024
#: Why a frame is skipped undecoded: (code, field, reason, limit).
_Refusal = tuple[str, str, str, int | None]


class FrameKind(enum.IntEnum):
    REQUEST = 0
    RESPONSE = 1
    ONEWAY = 2  # a request that gets no response (e.g. a tick to a slave)


@dataclass(frozen=True, slots=True)
class Frame:
    """One decoded (or to-be-encoded) frame; ``command`` is an int, known or not."""

    kind: FrameKind
    command: int
    request_id: int
    metadata: dict[str, Any] = field(default_factory=dict)
    body: bytes = b""


def encode_frame(frame: Frame, limits: CodecLimits = DEFAULT_CODEC_LIMITS) -> bytes:
    """The bytes of one frame; ``LocalProtocolError`` when it breaks a limit."""
    if not isinstance(frame.kind, int) or frame.kind not in _KINDS:
        raise LocalProtocolError(
            f"frame kind {frame.kind!r} is not one of {sorted(_KINDS)}",
            code="bad_frame",
            field="kind",
        )
    for name, value, cap in (
        ("command", frame.command, _U16),
        ("request_id", frame.request_id, _U32),
    ):
        if not isinstance(value, int) or not 0 <= value <= cap:
            raise LocalProtocolError(
                f"frame {name} {value!r} is outside 0..{cap}",
                code="bad_frame",
                field=name,
                limit=cap,
            )
    metadata = _encode_metadata(frame.metadata)
    body = frame.body
    if type(body) is not bytes:
        if not isinstance(body, bytes | bytearray | memoryview):
            raise LocalProtocolError(
                f"frame body is of type {type(body).__name__}, not bytes",
                code="bad_frame",
                field="body",
            )
        body = bytes(body)
    size = FRAME_HEADER_SIZE + len(metadata) + len(body)
    if size > limits.max_frame:
        raise LocalProtocolError(
            f"frame of {size} bytes (metadata {len(metadata)}, body {len(body)}) "
            f"exceeds the frame limit of {limits.max_frame}",
            code="oversize",
            field="frame",
            limit=limits.max_frame,
        )
    header = FRAME_HEADER.pack(MAGIC, VERSION, frame.kind, frame.command, frame.request_id, len(metadata), len(body))
    return b"".join((header, metadata, body))


_KINDS = frozenset(int(kind) for kind in FrameKind)


def _encode_metadata(metadata: Any) -> bytes:
    if not isinstance(metadata, dict):
        raise LocalProtocolError(
            f"frame metadata is of type {type(metadata).__name__}, not a dict",
            code="bad_metadata",
            field="metadata",
        )
    if not metadata:
        return b""
    for key in metadata:
        if type(key) is not str:
            raise LocalProtocolError(f"frame metadata key {key!r} is not a str", code="bad_metadata", field="metadata")
    try:
        return msgpack.packb(metadata, use_bin_type=True)
    except Exception as error:  # TypeError, OverflowError, ValueError from msgpack
        raise LocalProtocolError(
            f"frame metadata cannot be encoded as msgpack: {error}",
            code="bad_metadata",
            field="metadata",
        ) from None


class FrameDecoder:
    """Turns received bytes into frames, with no I/O of its own.

    ``feed()`` what the socket gave, then call ``next_frame()`` until it returns
    None (it needs more bytes), or iterate over the decoder. A frame with a bad
    magic, an unknown version or an oversize length is fatal: the stream can no
    longer be trusted, and the decoder refuses any further use. A frame whose
    header is sound but whose metadata or kind is not is skipped and reported
    with a non-fatal error that carries its ``request_id`` and ``command``, so a
    server can answer it and go on.

    Metadata past ``limits.max_metadata`` is refused from the header, and a
    request's metadata with too many objects or too deep (``shape.py``) before it
    is decoded, each as a skipped frame; ``serving`` (a server's decoder) skips a
    response frame the same way, so every frame a server decodes was counted. ``gate`` narrows what a connection may
    send until ``open_gate`` (a server with tokens, before AUTH): a larger frame
    is fatal, another command skipped with an ``unauthorized`` error; neither has
    its metadata decoded.
    """

    def __init__(self, limits: CodecLimits = DEFAULT_CODEC_LIMITS, *, serving: bool = False) -> None:
        self._limits = limits
        #: A server's decoder: a RESPONSE frame is skipped from its header, undecoded.
        self._serving = serving
        self._buf = bytearray()
        self._pos = 0  # bytes before this were consumed
        self._failed: ProtocolError | None = None
        self._gate: tuple[int, frozenset[int], str] | None = None

    def gate(self, *, max_frame: int, commands: frozenset[int], reason: str) -> None:
        """Until ``open_gate``: frames of at most ``max_frame`` bytes, of ``commands`` only; ``reason`` says why."""
        self._gate = (max_frame, commands, reason)

    def open_gate(self) -> None:
        self._gate = None

    @property
    def pending(self) -> int:
        """Bytes received but not yet handed out as a frame."""
        return len(self._buf) - self._pos

    def partial_frame(self) -> tuple[int, int, int] | None:
        """(command, request_id, size) of the frame at the front, once its header is in.

        A server that gives up on a half-sent frame answers its request with this.
        """
        if self._failed is not None or self.pending < FRAME_HEADER_SIZE:
            return None
        (_magic, _version, _kind, command, request_id, meta_len, body_len) = FRAME_HEADER.unpack_from(
            self._buf, self._pos
        )
        return command, request_id, FRAME_HEADER_SIZE + meta_len + body_len

    def discard(self) -> None:
        """Let go of every byte buffered: the connection is being closed, its memory is wanted back."""
        self._buf = bytearray()
        self._pos = 0

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        self._check_usable()
        self._buf += data

    def next_frame(self) -> Frame | None:
        """The next complete frame, or None when more bytes are needed."""
        self._check_usable()
        buf = self._buf
        pos = self._pos
        available = len(buf) - pos
        if available == 0:
            if pos:
                buf.clear()
                self._pos = 0
            return None
        if buf[pos : pos + 2] != MAGIC[:available]:
            magic = bytes(buf[pos : pos + 2])
            self._fail(f"bad frame magic {magic!r}, expected {MAGIC!r}", "bad_magic", "magic")
        if available < FRAME_HEADER_SIZE:
            return None
        (_magic, version, kind, command, request_id, meta_len, body_len) = FRAME_HEADER.unpack_from(buf, pos)
        size = FRAME_HEADER_SIZE + meta_len + body_len
        limit = self._limits.max_frame if self._gate is None else min(self._limits.max_frame, self._gate[0])
        if version != VERSION or size > limit:
            self._fail_header(version, size, limit, meta_len, body_len, request_id, command)
        if available < size:
            return None
        refusal = self._refusal(kind, command, meta_len)
        metadata, body, refusal = _frame_contents(buf, pos, kind, meta_len, body_len, refusal)
        # Buffer upkeep stays inline: small frames (ACKs, PULLs) feel each call per frame.
        end = pos + size
        self._pos = end
        if end == len(buf):
            buf.clear()
            self._pos = 0
        elif end >= _COMPACT_AT and end * 2 >= len(buf):
            del buf[:end]  # at worst a copy of the unread rest, once per half buffer read
            self._pos = 0
        if refusal is not None or isinstance(metadata, str) or kind not in _KINDS:
            raise _skipped_frame_error(kind, command, request_id, metadata, refusal)
        return Frame(FrameKind(kind), command, request_id, metadata, body)

    def _fail_header(
        self, version: int, size: int, limit: int, meta_len: int, body_len: int, request_id: int, command: int
    ) -> None:
        """Fail the stream on a header it cannot read past: an unknown version, or a frame over ``limit``."""
        if version != VERSION:
            self._fail(
                f"unknown frame version {version}, this side speaks {VERSION}",
                "unknown_version",
                "version",
            )
        if self._gate is not None:
            self._fail(
                f"frame of {size} bytes before AUTH: at most {limit} until {self._gate[2]}",
                "unauthorized",
                "frame",
                limit,
                request_id=request_id,
                command=command,
            )
        self._fail(
            f"frame of {size} bytes (metadata {meta_len}, body {body_len}) exceeds the frame limit of {limit}",
            "oversize",
            "frame",
            limit,
            request_id=request_id,
            command=command,
        )

    def _refusal(self, kind: int, command: int, meta_len: int) -> _Refusal | None:
        """(code, field, reason, limit) of a frame skipped undecoded: a response sent to a server, a
        command shut out by the gate, or metadata over ``max_metadata``."""
        if self._serving and kind == FrameKind.RESPONSE:
            return "bad_frame", "kind", "a response frame sent to a server", None
        if self._gate is not None and command not in self._gate[1]:
            allowed = ", ".join(sorted(command_name(code) for code in self._gate[1]))
            return "unauthorized", "token", f"only {allowed} until {self._gate[2]}", None
        if meta_len > self._limits.max_metadata:
            text = f"metadata of {meta_len} bytes exceeds the metadata limit of {self._limits.max_metadata}"
            return "limit", "metadata", text, self._limits.max_metadata
        return None

    def __iter__(self) -> Iterator[Frame]:
        """The complete frames buffered now; stops when more bytes are needed."""
        while (frame := self.next_frame()) is not None:
            yield frame

    def end_of_stream(self) -> None:
        """Say the peer closed; raises ``truncated`` if it stopped inside a frame."""
        self._check_usable()
        if self.pending:
            self._fail(f"the stream ended inside a frame ({self.pending} bytes pending)", "truncated", None)

    def _check_usable(self) -> None:
        if self._failed is not None:
            failed = self._failed
            raise RemoteProtocolError(
                f"the frame decoder stopped after a fatal error: {failed.message}",
                code=failed.code,
                field=failed.field,
                limit=failed.limit,
                fatal=True,
            )

    def _fail(
        self,
        message: str,
        code: str,
        field: str | None,
        limit: int | None = None,
        *,
        request_id: int | None = None,
        command: int | None = None,
    ) -> None:
        error = RemoteProtocolError(
            message,
            code=code,
            field=field,
            limit=limit,
            fatal=True,
            request_id=request_id,
            command=command,
        )
        self._failed = error
        raise error


def _decode_metadata(raw: memoryview) -> dict[str, Any] | str:
    """The metadata map, or a string saying why the bytes are not one."""
    try:
        metadata = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as error:  # msgpack raises many kinds for bad input
        return f"metadata is not valid msgpack ({type(error).__name__}: {error})"
    if type(metadata) is not dict:
        return f"metadata is msgpack type {type(metadata).__name__}, not a map"
    for key in metadata:
        if type(key) is not str:
            return f"metadata key {key!r} is not a str"
    return metadata


def _frame_contents(
    buf: bytearray, pos: int, kind: int, meta_len: int, body_len: int, refusal: _Refusal | None
) -> tuple[dict[str, Any] | str, bytes, _Refusal | None]:
    """(metadata, body, refusal) of the whole frame at ``buf[pos:]``; a refused frame's are left undecoded."""
    meta_start = pos + FRAME_HEADER_SIZE
    body_start = meta_start + meta_len
    with memoryview(buf) as view:
        raw_metadata = view[meta_start:body_start]
        try:
            if refusal is None and kind != FrameKind.RESPONSE:  # a response: from a server this side called
                refusal = _shape_refusal(raw_metadata)
            metadata = _decode_metadata(raw_metadata) if meta_len and refusal is None else {}
        finally:
            raw_metadata.release()
        body = bytes(view[body_start : body_start + body_len]) if body_len and refusal is None else b""
    return metadata, body, refusal


def _skipped_frame_error(
    kind: int, command: int, request_id: int, metadata: dict[str, Any] | str, refusal: _Refusal | None
) -> RemoteProtocolError:
    """The non-fatal error of a frame skipped whole: refused from its header, bad metadata, or an unknown kind."""
    if refusal is not None:
        code, field, text, cap = refusal
        return RemoteProtocolError(
            f"frame {request_id} ({command_name(command)}): {text}",
            code=code,
            field=field,
            limit=cap,
            request_id=request_id,
            command=command,
        )
    if isinstance(metadata, str):
        return RemoteProtocolError(
            f"frame {request_id} (command {command}): {metadata}",
            code="bad_metadata",
            field="metadata",
            request_id=request_id,
            command=command,
        )
    return RemoteProtocolError(
        f"frame {request_id} (command {command}): unknown frame kind {kind}",
        code="bad_frame",
        field="kind",
        request_id=request_id,
        command=command,
    )


def _shape_refusal(raw: memoryview) -> _Refusal | None:
    problem = shape_problem(raw, max_items=MAX_METADATA_ITEMS, max_depth=MAX_METADATA_DEPTH)
    return None if problem is None else ("limit", "metadata", f"metadata {problem}", None)


# -------------------------------------------------------------------- helpers


def request(command: int, request_id: int, metadata: dict[str, Any] | None = None, body: bytes = b"") -> Frame:
    return Frame(FrameKind.REQUEST, command, request_id, metadata or {}, body)


def oneway(command: int, metadata: dict[str, Any] | None = None, body: bytes = b"") -> Frame:
    return Frame(FrameKind.ONEWAY, command, 0, metadata or {}, body)


def response_to(frame: Frame, metadata: dict[str, Any] | None = None, body: bytes = b"") -> Frame:
    """The response to ``frame``: same command and request id."""
    return Frame(FrameKind.RESPONSE, frame.command, frame.request_id, metadata or {}, body)


def error_response(origin: Frame | ProtocolError | tuple[int, int], error: ProtocolError) -> Frame:
    """An error response, metadata ``{"error": error.to_dict()}``.

    ``origin`` is the request being answered: a ``Frame``, a ``(command,
    request_id)`` pair, or a non-fatal decoder error (which carries both).
    """
    if isinstance(origin, Frame):
        command, request_id = origin.command, origin.request_id
    elif isinstance(origin, ProtocolError):
        if origin.command is None or origin.request_id is None:
            raise ValueError(f"{origin!r} does not say which request it is about")
        command, request_id = origin.command, origin.request_id
    else:
        command, request_id = origin
    return Frame(FrameKind.RESPONSE, command, request_id, {"error": error.to_dict()})


def response_error(frame: Frame) -> PeerError | None:
    """The ``PeerError`` an error response carries, or None for any other frame.

    A malformed error map raises ``RemoteProtocolError``.
    """
    if frame.kind != FrameKind.RESPONSE or "error" not in frame.metadata:
        return None
    error = PeerError.from_dict(frame.metadata["error"])
    error.request_id = frame.request_id
    error.command = frame.command
    return error


__all__ = [
    "FRAME_HEADER_SIZE",
    "Frame",
    "FrameDecoder",
    "FrameKind",
    "encode_frame",
    "error_response",
    "oneway",
    "request",
    "response_error",
    "response_to",
]
