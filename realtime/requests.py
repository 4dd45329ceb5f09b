"""The realtime commands' request metadata, checked: every refusal names its field and limit.

A map from the network is checked here once and becomes a small frozen object,
so the handlers work on values they can trust. Unknown keys are refused (a typo
in an option must not silently change behaviour).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from delaymq.net.limits import Limits
from delaymq.protocol.errors import RemoteProtocolError
from delaymq.protocol.fields import PULL_STARTS, check_int, check_name
from delaymq.protocol.limits import DEFAULT_POLL_MS, FRAME_RESERVE, MAX_NAME, MAX_POLL_MS, MAX_PULL, MAX_PULL_AHEAD_MS
from delaymq.protocol.subjects import group_problem, retry_subject_problem

#: Most subjects one CONSUMER_HEARTBEAT may name.
MAX_HEARTBEAT_SUBJECTS = 10_000


@dataclass(frozen=True, slots=True)
class PullRequest:
    group: str
    consumer: str
    subject: str
    max: int
    max_bytes: int
    tags: tuple[str, ...]
    timeout_ms: int
    broadcast: bool
    earliest: bool
    #: Records sent ahead are handed out up to this long before due (the consumer holds them).
    ahead_ms: int = 0


@dataclass(frozen=True, slots=True)
class AckRequest:
    group: str
    consumer: str
    subject: str
    start: int
    end: int | None  # None only for a release: to the end of the consumer's pull log
    delay_ms: int | None  # NACK only: re-schedule after this delay (None: give back at once)
    dead: bool = False  # NACK only: to the group's dead-letter subject
    release: bool = False  # NACK only: never handed to the application, back with attempts unchanged

    @property
    def retry(self) -> bool:
        """A NACK that re-schedules or buries, rather than gives back at once."""
        return self.delay_ms is not None or self.dead


@dataclass(frozen=True, slots=True)
class HeartbeatRequest:
    group: str
    consumer: str
    subjects: tuple[str, ...]


def _refuse(message: str, code: str, field: str, limit: int | None = None) -> RemoteProtocolError:
    return RemoteProtocolError(message, code=code, field=field, limit=limit)


def _check_keys(command: str, metadata: dict[str, Any], allowed: frozenset[str]) -> None:
    for key in metadata:
        if key not in allowed:
            raise _refuse(
                f"{command}: unknown field {key!r} (known: {', '.join(sorted(allowed))})",
                "bad_request",
                key,
            )


def _text(command: str, metadata: dict[str, Any], name: str, limit: int) -> str:
    if name not in metadata:
        raise _refuse(f"{command}: field {name!r} is required", "bad_request", name)
    return _name(command, name, metadata[name], limit)


def _name(command: str, name: str, value: Any, limit: int) -> str:
    return check_name(value, name, limit, error=RemoteProtocolError, command=command)


def _group(command: str, metadata: dict[str, Any]) -> str:
    group = _text(command, metadata, "group", MAX_NAME)
    problem = group_problem(group)
    if problem:
        raise _refuse(f"{command}: {problem}", "bad_value", "group")
    return group


def _integer(command: str, metadata: dict[str, Any], name: str, low: int, high: int, default: int | None) -> int:
    value = metadata.get(name, default)
    if value is None:
        raise _refuse(f"{command}: field {name!r} is required", "bad_request", name)
    return check_int(value, name, low, high, error=RemoteProtocolError, command=command)


def _flag(command: str, metadata: dict[str, Any], name: str) -> bool:
    value = metadata.get(name, False)
    if type(value) is not bool:
        raise _refuse(f"{command}: {name} is of type {type(value).__name__}, not bool", "bad_value", name)
    return value


_PULL_KEYS = frozenset(
    {"group", "consumer", "subject", "max", "max_bytes", "tags", "timeout_ms", "broadcast", "from", "ahead_ms"}
)
_ACK_KEYS = frozenset({"group", "consumer", "subject", "start", "end"})
_NACK_KEYS = _ACK_KEYS | {"delay_ms", "dead", "release"}
_HEARTBEAT_KEYS = frozenset({"group", "consumer", "subjects"})
_I64_MAX = (1 << 63) - 1


def parse_pull(metadata: dict[str, Any], limits: Limits) -> PullRequest:
    _check_keys("PULL", metadata, _PULL_KEYS)
    group = _group("PULL", metadata)
    consumer = _text("PULL", metadata, "consumer", MAX_NAME)
    subject = _text("PULL", metadata, "subject", limits.max_subject)
    count = _integer("PULL", metadata, "max", 1, MAX_PULL, None)
    byte_cap = max(1, limits.max_frame - FRAME_RESERVE)
    max_bytes = _integer("PULL", metadata, "max_bytes", 1, byte_cap, byte_cap)
    timeout_ms = _integer("PULL", metadata, "timeout_ms", 0, MAX_POLL_MS, DEFAULT_POLL_MS)
    ahead_ms = _integer("PULL", metadata, "ahead_ms", 0, MAX_PULL_AHEAD_MS, 0)
    broadcast = _flag("PULL", metadata, "broadcast")
    start = metadata.get("from", "latest")
    if start not in PULL_STARTS:
        raise _refuse(f"PULL: from is {start!r}, must be 'latest' or 'earliest'", "bad_value", "from")
    raw_tags = metadata.get("tags", ())
    if raw_tags is None:
        raw_tags = ()
    if not isinstance(raw_tags, list | tuple):
        raise _refuse(f"PULL: tags is of type {type(raw_tags).__name__}, not a list", "bad_value", "tags")
    if len(raw_tags) > limits.max_tags:
        raise _refuse(f"PULL: {len(raw_tags)} tags, limit {limits.max_tags}", "limit", "tags", limits.max_tags)
    tags = tuple(_name("PULL", "tag", tag, limits.max_tag) for tag in raw_tags)
    return PullRequest(
        group, consumer, subject, count, max_bytes, tags, timeout_ms, broadcast, start == "earliest", ahead_ms
    )


def parse_ack(metadata: dict[str, Any], limits: Limits, *, nack: bool = False) -> AckRequest:
    command = "NACK" if nack else "ACK"
    _check_keys(command, metadata, _NACK_KEYS if nack else _ACK_KEYS)
    group = _group(command, metadata)
    consumer = _text(command, metadata, "consumer", MAX_NAME)
    subject = _text(command, metadata, "subject", limits.max_subject)
    start = _integer(command, metadata, "start", 0, _I64_MAX, None)
    release = nack and _flag(command, metadata, "release")
    end = None
    if not release or metadata.get("end") is not None:  # a release may run to the end of the pull log
        end = _integer(command, metadata, "end", 0, _I64_MAX, None)
        if end <= start:
            raise _refuse(f"{command}: range [{start}, {end}) is empty; end must exceed start", "bad_value", "end")
    delay_ms = None
    if nack and metadata.get("delay_ms") is not None:
        delay_ms = _integer(command, metadata, "delay_ms", 0, limits.horizon_ms, None)
    dead = nack and _flag(command, metadata, "dead")
    if release and (delay_ms is not None or dead):
        raise _refuse(
            f"{command}: release gives the range back at once; it takes no delay_ms or dead", "bad_value", "release"
        )
    if delay_ms is not None or dead:
        # Where the retry or dead letter goes must be a subject these limits allow.
        problem = retry_subject_problem(group, subject, limits.max_subject)
        if problem:
            raise _refuse(f"{command}: {problem}", "limit", "subject", limits.max_subject)
    return AckRequest(group, consumer, subject, start, end, delay_ms, dead, release)


def parse_heartbeat(metadata: dict[str, Any], limits: Limits) -> HeartbeatRequest:
    _check_keys("CONSUMER_HEARTBEAT", metadata, _HEARTBEAT_KEYS)
    group = _group("CONSUMER_HEARTBEAT", metadata)
    consumer = _text("CONSUMER_HEARTBEAT", metadata, "consumer", MAX_NAME)
    raw = metadata.get("subjects")
    if not isinstance(raw, list | tuple):
        raise _refuse(
            f"CONSUMER_HEARTBEAT: subjects is of type {type(raw).__name__}, not a list", "bad_value", "subjects"
        )
    if len(raw) > MAX_HEARTBEAT_SUBJECTS:
        raise _refuse(
            f"CONSUMER_HEARTBEAT: {len(raw)} subjects, limit {MAX_HEARTBEAT_SUBJECTS}",
            "limit",
            "subjects",
            MAX_HEARTBEAT_SUBJECTS,
        )
    subjects = tuple(_name("CONSUMER_HEARTBEAT", "subject", s, limits.max_subject) for s in raw)
    return HeartbeatRequest(group, consumer, subjects)


__all__ = [
    "AckRequest",
    "HeartbeatRequest",
    "PullRequest",
    "parse_ack",
    "parse_heartbeat",
    "parse_pull",
]
