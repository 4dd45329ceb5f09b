"""The wire metadata of CANCEL, MOVE and QUERY (docs/cancel.md), checked on the server.

A request names scheduled messages in exactly one way:

- by ids: ``{"ids": [str, ...]}``, 1 to ``MAX_IDS`` message ids;
- by business key: ``{"subject": str, "key": str}``, every message scheduled with
  that subject whose property ``key`` is that key.

MOVE adds ``"deliver_at": int`` (epoch ms; a past moment means now; beyond the
horizon refused naming ``deliver_at`` and the limit). Every refusal is a
``RemoteProtocolError`` with code ``bad_request`` naming the field and the limit.

The business key travels in a message's properties as ``key`` (``KEY_PROPERTY``): a
str of 1 to ``MAX_KEY`` UTF-8 bytes without control characters.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from delaymq.protocol.errors import ProtocolError, RemoteProtocolError
from delaymq.protocol.fields import check_name
from delaymq.protocol.limits import CodecLimits

#: Ids one request may name.
MAX_IDS = 1000
#: The property that carries a message's business key, and its limit in UTF-8 bytes.
KEY_PROPERTY = "key"
MAX_KEY = 256

_FIELDS = frozenset({"ids", "subject", "key", "deliver_at"})


@dataclass(frozen=True, slots=True)
class Selector:
    """What a CANCEL / MOVE / QUERY names: ``ids``, or ``subject`` and ``key``."""

    ids: tuple[str, ...] = ()
    subject: str | None = None
    key: str | None = None
    deliver_at: int | None = None  # MOVE only


def check_key(value: Any, *, field: str = KEY_PROPERTY, error: type[ProtocolError] = RemoteProtocolError) -> str:
    """``value`` if it is a business key; else ``error`` naming ``field`` and ``MAX_KEY``."""
    return check_name(value, field, MAX_KEY, error=error)


def parse_selector(
    metadata: Mapping[str, Any], *, command: str, limits: CodecLimits, now_ms: int | None = None, move: bool = False
) -> Selector:
    """The checked selector of a request (``move``: ``deliver_at`` required, checked
    against ``now_ms`` and ``limits.horizon_ms``; a past moment becomes ``now_ms``)."""
    allowed = _FIELDS if move else _FIELDS - {"deliver_at"}
    unknown = sorted(set(metadata) - allowed)
    if unknown:
        _refuse(command, f"field {unknown[0]!r} is not one of {sorted(allowed)}", unknown[0])
    deliver_at = None
    if move:
        if "deliver_at" not in metadata:
            _refuse(command, "deliver_at (epoch ms) is missing", "deliver_at")
        deliver_at = metadata["deliver_at"]
        if not isinstance(deliver_at, int) or isinstance(deliver_at, bool):
            _refuse(command, f"deliver_at is of type {type(deliver_at).__name__}, not int", "deliver_at")
        assert now_ms is not None
        latest = now_ms + limits.horizon_ms
        if deliver_at > latest:
            _refuse(
                command,
                f"deliver_at {deliver_at} is beyond the horizon of {limits.horizon_ms} ms (latest {latest})",
                "deliver_at",
                limits.horizon_ms,
            )
        deliver_at = max(deliver_at, now_ms)
    has_ids = "ids" in metadata
    has_key = "subject" in metadata or "key" in metadata
    if has_ids == has_key:
        _refuse(command, "name the messages by ids, or by subject and key: exactly one of them", "ids")
    if has_ids:
        ids = metadata["ids"]
        if not isinstance(ids, list | tuple):
            _refuse(command, f"ids is of type {type(ids).__name__}, not a list of str", "ids")
        if not 0 < len(ids) <= MAX_IDS:
            _refuse(command, f"ids holds {len(ids)} ids, must be 1 to {MAX_IDS}", "ids", MAX_IDS)
        for index, message_id in enumerate(ids):
            _checked(check_name, message_id, f"ids[{index}]", limits.max_id, command=command)
        return Selector(ids=tuple(dict.fromkeys(ids)), deliver_at=deliver_at)
    for field in ("subject", "key"):
        if field not in metadata:
            _refuse(command, f"{field} is missing: a key names messages together with their subject", field)
    subject = _checked(check_name, metadata["subject"], "subject", limits.max_subject, command=command)
    key = _checked(check_name, metadata["key"], "key", MAX_KEY, command=command)
    return Selector(subject=subject, key=key, deliver_at=deliver_at)


def _checked(check: Any, value: Any, field: str, limit: int, *, command: str) -> str:
    try:
        result: str = check(value, field, limit, error=RemoteProtocolError, command=command)
    except RemoteProtocolError as error:
        raise RemoteProtocolError(error.message, code="bad_request", field=field, limit=limit) from None
    return result


def _refuse(command: str, message: str, field: str, limit: int | None = None) -> None:
    raise RemoteProtocolError(f"{command}: {message}", code="bad_request", field=field, limit=limit)


__all__ = ["KEY_PROPERTY", "MAX_IDS", "MAX_KEY", "Selector", "check_key", "parse_selector"]
