"""A message's properties: a msgpack map of str keys to str, int, float, bool or bytes values.

The producer encodes them (``LocalProtocolError`` on a broken rule); a receiver
decodes them only when it wants them (``decode_message``, ``decode_batch``, a
scan with ``check_properties``), since a server otherwise stores them unread.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgpack

from delaymq.protocol.errors import LocalProtocolError
from delaymq.protocol.limits import CodecLimits

_PROPERTY_TYPES = (str, int, float, bytes)  # bool is an int


def encode_properties(properties: Mapping[str, Any], limits: CodecLimits) -> bytes:
    """The properties section of a record; ``LocalProtocolError`` names the rule broken."""
    if not isinstance(properties, Mapping):
        raise LocalProtocolError(
            f"properties is of type {type(properties).__name__}, not a mapping",
            code="bad_value",
            field="properties",
        )
    if not properties:
        return b""
    problem = property_problem(properties)
    if problem:
        raise LocalProtocolError(problem, code="bad_value", field="properties")
    try:
        data = msgpack.packb(dict(properties), use_bin_type=True)
    except (OverflowError, ValueError, TypeError) as error:  # ints beyond 64 bits, surrogates
        raise LocalProtocolError(
            f"properties cannot be encoded: {error}", code="bad_value", field="properties"
        ) from None
    if len(data) > limits.max_properties:
        raise LocalProtocolError(
            f"properties encode to {len(data)} bytes, limit {limits.max_properties}",
            code="limit",
            field="properties",
            limit=limits.max_properties,
        )
    return data


def decode_properties(data: bytes) -> dict[str, Any]:
    """Checked properties; ``ValueError`` says why they are not a valid properties map."""
    try:
        properties = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as error:  # msgpack raises many kinds for bad input
        raise ValueError(f"properties are not valid msgpack ({type(error).__name__}: {error})") from None
    if type(properties) is not dict:
        raise ValueError(f"properties are msgpack type {type(properties).__name__}, not a map")
    problem = property_problem(properties)
    if problem:
        raise ValueError(problem)
    return properties


def property_problem(properties: Mapping[Any, Any]) -> str | None:
    """Why ``properties`` is not a properties map (a key not a str, a value of another type), or None."""
    for key, value in properties.items():
        if type(key) is not str:
            return f"properties key {key!r} is of type {type(key).__name__}, not str"
        if not isinstance(value, _PROPERTY_TYPES):
            return f"properties[{key!r}] is of type {type(value).__name__}, not str, int, float, bool or bytes"
    return None


__all__ = ["decode_properties", "encode_properties", "property_problem"]
