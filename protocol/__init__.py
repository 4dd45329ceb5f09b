"""delaymq.protocol: the sans-IO wire codec (frames, message records, limits, errors, subject names).

Fed bytes, it hands out frames and checked record batches; it never does I/O.
The message record format is the same on the wire and in every log.
"""

from delaymq.protocol.commands import Command, command_name
from delaymq.protocol.envelope import RecordKind
from delaymq.protocol.errors import (
    LocalProtocolError,
    PeerError,
    ProtocolError,
    RemoteProtocolError,
)
from delaymq.protocol.frames import (
    FRAME_HEADER_SIZE,
    Frame,
    FrameDecoder,
    FrameKind,
    encode_frame,
    error_response,
    oneway,
    request,
    response_error,
    response_to,
)
from delaymq.protocol.limits import DEFAULT_CODEC_LIMITS, CodecLimits
from delaymq.protocol.records import (
    Message,
    MessageBatch,
    MessageHeader,
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
from delaymq.protocol.subjects import (
    DEAD_PREFIX,
    RETRY_PREFIX,
    dead_subject,
    group_problem,
    original_subject,
    retry_subject,
    retry_subject_problem,
)

__all__ = [
    "DEAD_PREFIX",
    "DEFAULT_CODEC_LIMITS",
    "FRAME_HEADER_SIZE",
    "RETRY_PREFIX",
    "Command",
    "Frame",
    "FrameDecoder",
    "FrameKind",
    "CodecLimits",
    "LocalProtocolError",
    "Message",
    "MessageBatch",
    "MessageHeader",
    "PeerError",
    "ProtocolError",
    "RecordKind",
    "RemoteProtocolError",
    "command_name",
    "dead_subject",
    "decode_batch",
    "decode_message",
    "encode_batch",
    "encode_frame",
    "encode_message",
    "error_response",
    "group_problem",
    "new_message_id",
    "oneway",
    "original_subject",
    "request",
    "response_error",
    "response_to",
    "retry_subject",
    "retry_subject_problem",
    "rewrite_delivery",
    "scan_batch",
    "tag_bit",
    "tags_mask",
]
