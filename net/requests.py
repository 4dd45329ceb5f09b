"""A request as a server's handler sees it, and what the transport reads of it before any handler
runs: which commands count against rates, which scope a token check is about."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from delaymq.net.auth import (
    GROUP_COMMANDS,
    SUBJECT_COMMANDS,
    Identity,
    Scope,
)
from delaymq.protocol.commands import Command, command_name
from delaymq.protocol.envelope import EnvelopeError, RecordKind, iter_spans
from delaymq.protocol.errors import (
    RemoteProtocolError,
)
from delaymq.protocol.fencing import FENCE_FIELD
from delaymq.protocol.frames import (
    Frame,
)
from delaymq.protocol.records import RECORD_HEADER_SIZE, record_subject

#: What a handler returns: response metadata, or (metadata, body).
Reply = dict[str, Any] | tuple[dict[str, Any], bytes] | None
Handler = Callable[["Request"], Awaitable[Reply]]
#: Commands whose batches count against a token's message and byte rates (every request counts
#: against ``requests_per_s``).
RATED_COMMANDS = frozenset({Command.SEND, Command.SCHEDULE})
#: What a connection may send before its AUTH is accepted, on a server with a tokens file.
UNAUTHENTICATED_COMMANDS = frozenset({Command.AUTH, Command.PING})
#: The request id of an error frame about the connection itself (a refusal), not a request.
CONNECTION_REQUEST_ID = 0


@dataclass(frozen=True, slots=True)
class Request:
    """One request as a handler sees it; ``identity`` is who its token is (None: no tokens file)."""

    frame: Frame
    peer: str
    identity: Identity | None = None
    #: The connection it came on: a handler may bind state to it (a registration).
    connection: int = 0

    @property
    def metadata(self) -> dict[str, Any]:
        return self.frame.metadata

    @property
    def body(self) -> bytes:
        return self.frame.body

    def batch_body(self, *, fields: tuple[str, ...] = ()) -> bytes:
        """The records of a batch command (SEND, SCHEDULE): no metadata but ``fields``, and some bytes.

        ``RemoteProtocolError`` (``bad_request``) names the field that is wrong.
        """
        command = command_name(self.frame.command)
        key = next((key for key in self.metadata if key not in fields), None) if self.metadata else None
        if key is not None:
            takes = f"no metadata but {', '.join(fields)}" if fields else "no metadata"
            raise RemoteProtocolError(
                f"{command}: unknown field {key!r} ({command} takes {takes}; the batch is the body)",
                code="bad_request",
                field=key,
            )
        if not self.body:
            raise RemoteProtocolError(f"{command}: the body holds no records", code="bad_request", field="body")
        return self.body


def batch_messages(frame: Frame) -> int:
    """The message records in a SEND's or SCHEDULE's body (its subjects were read without error before)."""
    try:
        return sum(1 for span in iter_spans(frame.body) if span.kind == RecordKind.MESSAGE)
    except EnvelopeError as error:
        raise RemoteProtocolError(f"{command_name(frame.command)}: {error}", code="bad_record", field="body") from None


def request_scope(frame: Frame) -> Scope:
    """What a request acts on, for the token's patterns (``auth.Scope``).

    SEND and SCHEDULE: the subject of each message record of the body, and a
    SEND's fence (the scheduler group it speaks for); REGISTER: the kind and
    group it registers; consumer commands: their ``group``; the others: their
    metadata's ``subject`` (``subjects`` for CONSUMER_HEARTBEAT). A field of the
    wrong type is left out here for the handler to refuse; a body whose records
    do not check is refused here as the handler would refuse it (``bad_record``).
    """
    command = frame.command
    metadata = frame.metadata if isinstance(frame.metadata, dict) else {}
    group = metadata.get("group") if command in GROUP_COMMANDS else None
    group = group if isinstance(group, str) else None
    server = _server_scope(command, metadata)
    subjects = _request_subjects(frame, metadata) if command in SUBJECT_COMMANDS else ()
    return Scope(None if subjects is None else tuple(subjects), group, server)


def _server_scope(command: int, metadata: dict[str, Any]) -> tuple[str, str] | None:
    """The (kind, group) a REGISTER or a fenced SEND speaks as."""
    if command == Command.REGISTER:
        kind, group = metadata.get("kind"), metadata.get("group")
        return (kind, group) if isinstance(kind, str) and isinstance(group, str) else None
    fence = metadata.get(FENCE_FIELD) if command == Command.SEND else None
    if isinstance(fence, dict) and isinstance(fence.get("group"), str):
        return ("scheduler", fence["group"])
    if fence is not None:  # malformed: only a server may carry a fence at all
        return ("scheduler", "?")
    return None


def _request_subjects(frame: Frame, metadata: dict[str, Any]) -> list[str] | None:
    command = frame.command
    if command in (Command.SEND, Command.SCHEDULE):
        subjects: dict[str, None] = {}
        try:
            for span in iter_spans(frame.body):
                if span.kind == RecordKind.MESSAGE and span.end - span.start >= RECORD_HEADER_SIZE:
                    with memoryview(frame.body)[span.start : span.end] as record:
                        subjects[record_subject(record).decode(errors="replace")] = None
        except EnvelopeError as error:
            raise RemoteProtocolError(f"{command_name(command)}: {error}", code="bad_record", field="body") from None
        return list(subjects)
    if command == Command.CONSUMER_HEARTBEAT:
        listed = metadata.get("subjects")
        return [subject for subject in listed if isinstance(subject, str)] if isinstance(listed, list) else []
    subject = metadata.get("subject")
    if isinstance(subject, str):
        return [subject]
    if command in (Command.CANCEL, Command.MOVE, Command.QUERY):
        return None  # by ids (or malformed: the handler says so to a token that may name any subject)
    return []
