"""The limits of what servers and snapshots may say, and the checks that enforce them.

Each check returns the value it accepted, or raises a ``RegistryError`` naming
the field, so requests and snapshots are refused before anything changes.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from typing import Any, TypeVar

from delaymq.metaserver.errors import RegistryError

GROUP_NAME_MAX = 128
HOST_MAX = 255
SOFTWARE_VERSION_MAX = 64
INCARNATION_MAX = 64
MEMBER_MAX = 64
#: Addresses a master may list as in sync.
IN_SYNC_MAX = 64
#: Offsets and epochs are msgpack integers: at most a signed 64-bit value.
INT_MAX = 2**63 - 1
# Only the record format's own cap: the configured subject limit is the
# protocol's to enforce, and the metaserver must not refuse what it allows.
SUBJECT_MAX_BYTES = 0xFFFF
PORT_MIN, PORT_MAX = 1, 65535

_GROUP_NAME = re.compile(r"[A-Za-z0-9._-]+")
_E = TypeVar("_E", bound=enum.Enum)


def shown(value: object) -> str:
    """``value`` as an error message quotes it: its repr, cut short."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_text(field: str, value: object, limit: int) -> str:
    if not isinstance(value, str):
        raise RegistryError(field, f"must be a string, got {type(value).__name__}")
    if not value:
        raise RegistryError(field, "must not be empty")
    if len(value) > limit:
        raise RegistryError(field, f"is {len(value)} characters, limit {limit}")
    return value


def check_optional_text(field: str, value: object, limit: int) -> str | None:
    return None if value is None else check_text(field, value, limit)


def check_choice(field: str, kind: type[_E], value: object) -> _E:
    try:
        return kind(value)
    except (ValueError, TypeError):
        allowed = ", ".join(repr(choice.value) for choice in kind)
        raise RegistryError(field, f"unknown {field} {shown(value)}, expected one of {allowed}") from None


def check_count(field: str, value: object, *, minimum: int = 0, maximum: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise RegistryError(field, f"must be an integer, got {type(value).__name__}")
    if value < minimum:
        raise RegistryError(field, f"is {value}, must be at least {minimum}")
    if maximum is not None and value > maximum:
        raise RegistryError(field, f"is {value}, limit {maximum}")
    return value


def check_mapping(field: str, value: object) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise RegistryError(field, f"must be a mapping, got {type(value).__name__}")
    return value


def check_group_name(value: object, field: str = "group") -> str:
    """1..128 characters of A-Z a-z 0-9 . _ -"""
    name = check_text(field, value, GROUP_NAME_MAX)
    if not _GROUP_NAME.fullmatch(name):
        raise RegistryError(field, f"{shown(name)} may use only A-Z a-z 0-9 . _ -")
    return name


def check_address(value: object, field: str = "address") -> str:
    """``host:port`` (IPv6 hosts in brackets), port 1..65535 written plainly."""
    address = check_text(field, value, HOST_MAX + 6)
    host, colon, port = address.rpartition(":")
    if not colon or not host:
        raise RegistryError(field, f"{shown(address)} is not host:port")
    bracketed = host.startswith("[") and host.endswith("]")
    bare = host[1:-1] if bracketed else host
    if not bare or (":" in bare and not bracketed) or any(c.isspace() or c in "[]/" for c in bare):
        raise RegistryError(field, f"{shown(address)} has a bad host (IPv6 goes in brackets)")
    if len(host) > HOST_MAX:
        raise RegistryError(field, f"host is {len(host)} characters, limit {HOST_MAX}")
    if not (port.isascii() and port.isdigit()) or port != str(int(port)):
        raise RegistryError(field, f"{shown(address)} has port {shown(port)}, not a plain number")
    if not PORT_MIN <= int(port) <= PORT_MAX:
        raise RegistryError(field, f"port {port} is outside {PORT_MIN}..{PORT_MAX}")
    return address


def check_subject(value: object) -> None:
    subject = check_text("subject", value, SUBJECT_MAX_BYTES)
    try:
        size = len(subject.encode("utf-8"))
    except UnicodeEncodeError:
        raise RegistryError("subject", "is not valid UTF-8 text") from None
    if size > SUBJECT_MAX_BYTES:
        raise RegistryError("subject", f"is {size} UTF-8 bytes, limit {SUBJECT_MAX_BYTES}")


__all__ = [
    "GROUP_NAME_MAX",
    "HOST_MAX",
    "INCARNATION_MAX",
    "INT_MAX",
    "IN_SYNC_MAX",
    "MEMBER_MAX",
    "PORT_MAX",
    "PORT_MIN",
    "SOFTWARE_VERSION_MAX",
    "SUBJECT_MAX_BYTES",
    "check_address",
    "check_choice",
    "check_count",
    "check_group_name",
    "check_mapping",
    "check_optional_text",
    "check_subject",
    "check_text",
    "shown",
]
