"""Checks of single fields that both ends of the wire make: names and bounded integers.

A name (subject, message id, tag, consumer group, consumer id) is 1 to ``limit``
UTF-8 bytes of valid Unicode with no control character. The side that checks
picks the error: a client about to send raises ``LocalProtocolError`` (the
default), a server checking a request ``RemoteProtocolError``, prefixed with the
request's ``command``. Either way the refusal names the field and the limit.
"""

from __future__ import annotations

import re
from typing import Any

from delaymq.protocol.errors import LocalProtocolError, ProtocolError

# Unicode category Cc: C0, DEL and C1 controls. ``str.isprintable`` is a fast
# first check (true for most ids and subjects); the regex settles the rest.
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")

#: Where a new PULL share may start: the consume log's end, or its first entry.
PULL_STARTS = ("latest", "earliest")


def encode_name(
    value: Any,
    field: str,
    limit: int,
    *,
    error: type[ProtocolError] = LocalProtocolError,
    command: str | None = None,
) -> bytes:
    """``value``'s UTF-8 bytes, if it is a name of at most ``limit`` bytes; else raise ``error``."""
    # The command's prefix is made only for a refusal: this runs for every id a producer sends.
    if type(value) is not str:
        raise error(
            f"{_prefix(command)}{field} is of type {type(value).__name__}, not str", code="bad_value", field=field
        )
    try:
        data = value.encode()
    except UnicodeEncodeError:
        raise error(
            f"{_prefix(command)}{field} {value!r} is not valid Unicode text", code="bad_value", field=field
        ) from None
    if not 0 < len(data) <= limit:
        raise error(
            f"{_prefix(command)}{field} is {len(data)} UTF-8 bytes, must be 1 to {limit}",
            code="limit",
            field=field,
            limit=limit,
        )
    if not value.isprintable() and CONTROL.search(value):
        raise error(f"{_prefix(command)}{field} {value!r} holds a control character", code="bad_value", field=field)
    return data


def _prefix(command: str | None) -> str:
    return f"{command}: " if command else ""


def check_name(
    value: Any,
    field: str,
    limit: int,
    *,
    error: type[ProtocolError] = LocalProtocolError,
    command: str | None = None,
) -> str:
    """``value``, if it is a name of at most ``limit`` UTF-8 bytes; else raise ``error``."""
    encode_name(value, field, limit, error=error, command=command)
    return value  # encode_name checked that it is a str


def check_int(
    value: Any,
    field: str,
    low: int,
    high: int,
    *,
    error: type[ProtocolError] = LocalProtocolError,
    command: str | None = None,
) -> int:
    """``value``, if it is an int (not a bool) from ``low`` to ``high``; else raise ``error``."""
    prefix = f"{command}: " if command else ""
    if not isinstance(value, int) or isinstance(value, bool):
        raise error(f"{prefix}{field} is of type {type(value).__name__}, not int", code="bad_value", field=field)
    if not low <= value <= high:
        raise error(
            f"{prefix}{field} is {value}, must be {low} to {high}",
            code="limit",
            field=field,
            limit=high if value > high else low,
        )
    return value


__all__ = ["CONTROL", "PULL_STARTS", "check_int", "check_name", "encode_name"]
