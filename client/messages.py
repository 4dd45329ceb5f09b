"""The producer's sans-IO core: build and check messages, and pack batches into frames.

Everything a ``Producer`` decides before any byte leaves the process (a
``BlockingProducer`` runs the same ``Producer`` on a loop thread) lives here,
fed the time in epoch milliseconds:

- ``delivery_time`` turns ``delay=`` / ``at=`` into an absolute ``deliver_at``;
- ``build_message`` makes a checked ``Message`` with a client-side id, so a
  batch refused by one server group and sent again to another carries the
  same ids (servers drop an id they already stored);
- ``plan_frames`` encodes a batch (every record checked, the horizon too),
  splits it by route (immediate → realtime SEND, delayed → scheduler
  SCHEDULE) and packs each route's records into frames under the size limits.

A refusal is a ``LocalProtocolError`` naming the field and the limit broken,
and, for a batch, the message's ``index``; nothing is sent then.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from itertools import repeat
from typing import Any

from delaymq.protocol.cancel import KEY_PROPERTY, MAX_KEY
from delaymq.protocol.cancel import check_key as check_key_field
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import LocalProtocolError, RemoteProtocolError
from delaymq.protocol.fields import encode_name
from delaymq.protocol.limits import DEFAULT_CODEC_LIMITS, FRAME_RESERVE, CodecLimits, MiB
from delaymq.protocol.records import Message, make_message, make_plain_message, new_message_id
from delaymq.protocol.routes import RouteKind

DEFAULT_BATCH_BYTES = 4 * MiB
DEFAULT_BATCH_MESSAGES = 1000

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MS = timedelta(milliseconds=1)
_DAY_MS = 86_400_000

#: What ``delay=`` takes: seconds, or a timedelta.
Delay = float | int | timedelta
#: What ``at=`` takes: an aware datetime, or epoch milliseconds.
At = datetime | int


def iso(ms: int) -> str:
    """Epoch ms as ISO 8601 UTC text, for messages and output."""
    try:
        return (_EPOCH + ms * _MS).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    except OverflowError:
        return f"epoch ms {ms}"


def delivery_time(*, delay: Delay | None = None, at: At | None = None, now_ms: int) -> int | None:
    """The ``deliver_at`` that ``delay``/``at`` ask for; None when neither is given.

    ``delay`` is seconds (int or float) or a ``timedelta``, rounded up to the
    millisecond (a delay queue must never deliver early); ``at`` is a
    timezone-aware ``datetime`` or epoch milliseconds. A naive datetime is
    refused: its meaning depends on the machine's local time.
    """
    if delay is not None and at is not None:
        raise LocalProtocolError("give delay or at, not both", code="bad_value", field="at")
    if delay is not None:
        return now_ms + _delay_ms(delay)
    if at is not None:
        return _at_ms(at)
    return None


def seconds_to_ms(value: Any, *, name: str = "delay", field: str = "delay") -> int:
    """Seconds (int or float) or a ``timedelta`` as milliseconds, rounded up: a delay never ends early.

    ``name`` is how a refusal names the value (``retry_delays[2]``), ``field`` the option it is in.
    """
    if isinstance(value, float):  # the common case first (a float subclass too: numpy's, say)
        if math.isfinite(scaled := value * 1000):
            return math.ceil(scaled)
        # Infinite, NaN, or so large its milliseconds are (1e306 s): never a moment to wait for.
        raise LocalProtocolError(
            f"{name} is {value!r}, not a finite number of seconds (in milliseconds)", code="bad_value", field=field
        )
    if isinstance(value, timedelta):
        return -(-value // _MS)
    if isinstance(value, int) and not isinstance(value, bool):
        return value * 1000
    raise LocalProtocolError(
        f"{name} is of type {type(value).__name__}; give seconds (int or float) or a timedelta",
        code="bad_value",
        field=field,
    )


def _delay_ms(delay: Delay) -> int:
    ms = seconds_to_ms(delay)
    if ms < 0:
        raise LocalProtocolError(f"delay is {delay!r}; it must be zero or more", code="limit", field="delay", limit=0)
    return ms


def _at_ms(at: At) -> int:
    if isinstance(at, datetime):
        if at.tzinfo is None or at.utcoffset() is None:
            raise LocalProtocolError(
                f"at is the naive datetime {at.isoformat()}; give a timezone "
                "(e.g. tzinfo=timezone.utc) so the moment does not depend on this machine's local time",
                code="bad_value",
                field="at",
            )
        return (at - _EPOCH) // _MS
    if isinstance(at, int) and not isinstance(at, bool):
        return at
    raise LocalProtocolError(
        f"at is of type {type(at).__name__}; give an aware datetime or epoch milliseconds (int)",
        code="bad_value",
        field="at",
    )


def check_key(value: Any, field: str = KEY_PROPERTY) -> str:
    """``value`` if it is a business key (a str of 1 to ``MAX_KEY`` UTF-8 bytes, no control
    character); else ``LocalProtocolError`` naming ``field`` and the limit."""
    return check_key_field(value, field=field, error=LocalProtocolError)


def check_key_property(properties: Any) -> None:
    """Check the ``key`` property when a message carries one (as a field of its own is checked)."""
    if properties and isinstance(properties, Mapping) and KEY_PROPERTY in properties:  # (most have none)
        check_key(properties[KEY_PROPERTY])


def check_horizon(deliver_at: int, now_ms: int, limits: CodecLimits) -> None:
    """Refuse a ``deliver_at`` further ahead than ``limits.horizon_ms`` (never clamp it)."""
    ahead = deliver_at - now_ms
    if ahead > limits.horizon_ms:
        raise LocalProtocolError(
            f"deliver_at {iso(deliver_at)} is {ahead / _DAY_MS:.1f} days ahead; the horizon is "
            f"{limits.horizon_ms / _DAY_MS:g} days (horizon_ms {limits.horizon_ms})",
            code="horizon",
            field="deliver_at",
            limit=limits.horizon_ms,
        )


def build_message(
    subject: str,
    body: bytes | str = b"",
    *,
    tags: Iterable[str] = (),
    properties: Mapping[str, Any] | None = None,
    id: str | None = None,
    delay: Delay | None = None,
    at: At | None = None,
    key: str | None = None,
    now_ms: int,
    limits: CodecLimits = DEFAULT_CODEC_LIMITS,
    check: bool = True,
) -> Message:
    """A checked message: id made here unless given (None), ``created_at`` now, ``deliver_at`` resolved.

    ``key`` (a business key such as ``order-42``) travels as the property ``key``; a
    cancel, move or query by subject and key reaches every message sent with it.

    A message due now gets ``deliver_at = now`` (or the past ``at`` asked for),
    so a consumer can tell how late it arrived. A ``str`` body is sent as UTF-8.
    ``check=False`` leaves the field checks to ``plan_frames`` (which encodes
    anyway), so a message sent at once is encoded only once.
    """
    if (  # the common case, a producer's hot path (``_plain_message``)
        type(subject) is str
        and type(body) is bytes
        and type(tags) is tuple
        and not tags
        and properties is None
        and id is None
        and at is None
        and key is None
    ):
        message = _plain_message(subject, body, delay, now_ms, limits)
        if message is not None:
            return message
    if isinstance(body, str):
        body = body.encode()
    if type(tags) is not tuple:
        if isinstance(tags, str):
            raise LocalProtocolError("tags is a str, not a sequence of str", code="bad_value", field="tags")
        tags = tuple(tags)
    if id == "":  # "no id" is None; an empty one is a mistake (a blank field, a missing lookup), not a wish
        raise LocalProtocolError(
            f"id is empty; give 1 to {limits.max_id} UTF-8 bytes, or leave id out (None) to have one made",
            code="limit",
            field="id",
            limit=limits.max_id,
        )
    deliver_at = delivery_time(delay=delay, at=at, now_ms=now_ms)
    if deliver_at is None:
        deliver_at = now_ms
    # A non-mapping is left for encode() to refuse, naming the field.
    if properties is None:
        props: Any = {}
    else:
        props = dict(properties) if isinstance(properties, Mapping) else (properties or {})
    if key is not None and isinstance(props, dict):  # (a non-mapping is refused by encode())
        if KEY_PROPERTY in props and props[KEY_PROPERTY] != key:
            raise LocalProtocolError(
                f"key {key!r} and properties['key'] {props[KEY_PROPERTY]!r} differ; give one of them",
                code="bad_value",
                field="key",
            )
        props[KEY_PROPERTY] = check_key(key)
    else:
        check_key_property(props)
    if id is None:
        id = new_message_id(now_ms)
    elif type(id) is not str and isinstance(id, str):
        id = str(id)  # a ``SentId`` sent again goes as the plain str it is
    if type(props) is dict and type(body) is bytes:
        message = make_message(id, subject, tags, props, body, deliver_at, now_ms)
    else:  # odd types: the dataclass's own checks, and encode() names the field
        message = Message(id, subject, tags=tags, properties=props, body=body, deliver_at=deliver_at, created_at=now_ms)
    check_horizon(deliver_at, now_ms, limits)
    if check:
        message.encode(limits)  # every field and limit checked now, not at send time
    return message


def _plain_message(subject: str, body: bytes, delay: Delay | None, now_ms: int, limits: CodecLimits) -> Message | None:
    """``build_message`` of a subject, a bytes body and a ``delay`` alone: a producer's common case,
    checked and encoded in one pass, with no copy of the properties and no second look at the record.

    Raises what ``build_message`` would for the delay and the horizon (nothing it checks before
    them can fail for these arguments); None when a field breaks a limit, so that
    ``build_message``'s own path names it (or, with ``check=False``, leaves it to ``plan_frames``).
    """
    if delay is None:
        deliver_at = now_ms
    elif type(delay) is float and 0.0 <= (scaled := delay * 1000) < _INFINITY:  # (NaN is neither)
        deliver_at = now_ms + _ceil(scaled)  # as ``seconds_to_ms`` rounds: a delay never ends early
    else:
        deliver_at = now_ms + _delay_ms(delay)
    check_horizon(deliver_at, now_ms, limits)
    subject_bytes = _SUBJECT_BYTES.get(subject)
    if subject_bytes is None:
        try:
            subject_bytes = encode_name(subject, "subject", limits.max_subject)
        except LocalProtocolError:
            return None
        if len(_SUBJECT_BYTES) >= SUBJECTS_KEPT:
            _SUBJECT_BYTES.clear()
        _SUBJECT_BYTES[subject] = subject_bytes
    return make_plain_message(subject, subject_bytes, body, deliver_at, now_ms, limits)


#: How many subjects ``_plain_message`` keeps checked and encoded (a producer sends a few again
#: and again); past it, it starts over.
SUBJECTS_KEPT = 1024
_SUBJECT_BYTES: dict[str, bytes] = {}
_INFINITY = math.inf
_ceil = math.ceil


# --------------------------------------------------------------------- frames


@dataclass(frozen=True, slots=True)
class OutgoingFrame:
    """One request to send: a batch body for one route, and which messages it holds."""

    route: RouteKind
    command: Command
    body: bytes
    indexes: tuple[int, ...]  # positions of its records in the caller's batch

    def __len__(self) -> int:
        return len(self.indexes)


class SentId(str):
    """A sent message's id (a ``str``), and ``group``: the scheduler group that stored it.

    ``group`` is None for a message sent for delivery now (a realtime group holds it),
    or when the server did not say. ``producer.cancel(sent, group=sent.group)`` asks
    only that group.
    """

    group: str | None

    def __new__(cls, id: str, group: str | None = None) -> SentId:
        sent = super().__new__(cls, id)
        sent.__dict__["group"] = group  # (__setattr__ refuses)
        return sent

    @classmethod
    def many(cls, ids: Iterable[str], groups: Iterable[str | None]) -> list[SentId]:
        """``[SentId(id, group) for id, group in zip(ids, groups)]`` at about half the cost: a
        batch's ids are made by ``str.__new__`` itself, not through a Python ``__new__`` each."""
        made: list[SentId] = list(map(str.__new__, repeat(cls), ids))
        for sent, group in zip(made, groups, strict=True):
            sent.__dict__["group"] = group  # (__setattr__ refuses)
        return made

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"SentId is read-only: cannot set {name}")

    def __getnewargs__(self) -> tuple[str, str | None]:  # type: ignore[override]
        return str(self), self.group


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """A checked batch: the id of every message, in order, and the frames carrying them."""

    ids: list[str]
    frames: list[OutgoingFrame]


def plan_frames(
    messages: Sequence[Message],
    *,
    now_ms: int,
    limits: CodecLimits = DEFAULT_CODEC_LIMITS,
    max_bytes: int = DEFAULT_BATCH_BYTES,
    max_messages: int = DEFAULT_BATCH_MESSAGES,
) -> BatchPlan:
    """Encode and check every message, split by route, pack into frames.

    A message with an empty id gets a fresh one, one with ``created_at == 0``
    gets ``now``. ``deliver_at > now`` goes to the scheduler, anything else to
    a realtime group. Frames hold at most ``max_messages`` records and
    ``max_bytes`` bytes (and always fit ``limits.max_frame``); a record larger
    than ``max_bytes`` travels alone. Order within a route is kept.
    """
    if max_messages < 1:
        raise ValueError(f"max_messages is {max_messages}, must be at least 1")
    if max_bytes < 1:
        raise ValueError(f"max_bytes is {max_bytes}, must be at least 1")
    frame_bytes = min(max_bytes, max(1, limits.max_frame - FRAME_RESERVE))
    max_record = limits.max_frame - FRAME_RESERVE
    ids: list[str] = []
    immediate = _Packer(RouteKind.IMMEDIATE_PRODUCER, Command.SEND)
    delayed = _Packer(RouteKind.DELAYED_PRODUCER, Command.SCHEDULE)
    frames: list[OutgoingFrame] = []
    for index, message in enumerate(messages):
        try:
            if not isinstance(message, Message):
                raise LocalProtocolError(
                    f"is of type {type(message).__name__}, not Message (build one with producer.message(...))",
                    code="bad_value",
                    field="messages",
                )
            if not message.id or not message.created_at:
                message = replace(
                    message,
                    id=message.id or new_message_id(now_ms),
                    created_at=message.created_at or now_ms,
                )
            check_horizon(message.deliver_at, now_ms, limits)
            if message.properties:  # (most have none: no call then)
                check_key_property(message.properties)
            record = message.encode(limits)  # made once when producer.message checked it
        except LocalProtocolError as error:
            error.index = index
            error.message = f"messages[{index}]: {error.message}"
            error.args = (error.message,)
            raise
        if len(record) > max_record:
            raise LocalProtocolError(
                f"messages[{index}]: the record is {len(record)} bytes; a frame holds at most "
                f"{max_record} (max_frame {limits.max_frame})",
                code="limit",
                field="max_frame",
                limit=limits.max_frame,
                index=index,
            )
        ids.append(message.id)
        packer = delayed if message.deliver_at > now_ms else immediate
        frame = packer.add(index, record, frame_bytes, max_messages)
        if frame is not None:
            frames.append(frame)
    for packer in (immediate, delayed):
        frame = packer.flush()
        if frame is not None:
            frames.append(frame)
    return BatchPlan(ids, frames)


class _Packer:
    """Records of one route, cut into frames as they fill."""

    __slots__ = ("route", "command", "records", "indexes", "size")

    def __init__(self, route: RouteKind, command: Command) -> None:
        self.route = route
        self.command = command
        self.records: list[bytes] = []
        self.indexes: list[int] = []
        self.size = 0

    def add(self, index: int, record: bytes, max_bytes: int, max_messages: int) -> OutgoingFrame | None:
        full = None
        if self.records and (self.size + len(record) > max_bytes or len(self.records) >= max_messages):
            full = self.flush()
        self.records.append(record)
        self.indexes.append(index)
        self.size += len(record)
        return full

    def flush(self) -> OutgoingFrame | None:
        if not self.records:
            return None
        frame = OutgoingFrame(self.route, self.command, b"".join(self.records), tuple(self.indexes))
        self.records, self.indexes, self.size = [], [], 0
        return frame


#: What a server answers per record it holds: stored now (realtime), scheduled, or held already (a retry).
STORED_RESULTS = frozenset({"stored", "scheduled", "duplicate"})


def check_results(frame: OutgoingFrame, metadata: Mapping[str, Any]) -> list[str]:
    """The per-record results of a SEND/SCHEDULE answer, checked against the frame sent.

    Every record must be answered with one of ``STORED_RESULTS``: "duplicate"
    (a retry of a batch whose first answer was lost) is as good as "stored";
    anything else is not counted as stored.
    """
    results = metadata.get("results")
    if (
        not isinstance(results, list)
        or len(results) != len(frame)
        or not all(isinstance(r, str) and r in STORED_RESULTS for r in results)
    ):
        raise RemoteProtocolError(
            f"{frame.command.name} answer 'results' should be a list of {len(frame)} of "
            f"{', '.join(sorted(STORED_RESULTS))}, got {results!r:.200}",
            code="bad_metadata",
            field="results",
        )
    return results


def with_batch_index(error: Exception, frame: OutgoingFrame) -> Exception:
    """A refusal naming a record of the frame, renumbered to the caller's batch."""
    index = getattr(error, "index", None)
    if isinstance(index, int) and 0 <= index < len(frame.indexes):
        error.index = frame.indexes[index]  # type: ignore[attr-defined]
    return error


__all__ = [
    "KEY_PROPERTY",
    "MAX_KEY",
    "STORED_RESULTS",
    "At",
    "SentId",
    "BatchPlan",
    "Delay",
    "OutgoingFrame",
    "build_message",
    "check_horizon",
    "check_key",
    "check_key_property",
    "check_results",
    "delivery_time",
    "iso",
    "plan_frames",
    "seconds_to_ms",
    "with_batch_index",
]
