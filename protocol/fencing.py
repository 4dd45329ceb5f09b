"""Fencing: a scheduler's SEND names its group and epoch, so a deposed master is stopped by its sink.

The metaserver gives every change of a scheduler group's master a new, higher
epoch. The master puts ``Fence(group, epoch).as_metadata()`` on each SEND to a
realtime server; the realtime server remembers, durably, the highest epoch it
has seen per scheduler group and refuses a lower one with code ``FENCED``
(``fenced_error``). So an old master that has not heard of its replacement is
refused by the first realtime server the new master reached, whether or not
the metaserver is reachable. ``FENCED`` is not a retry code: the sender must
stop and rejoin as a slave, not try elsewhere.

A SEND without a fence (a producer's) is not fenced.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from delaymq.protocol.errors import LocalProtocolError, ProtocolError, RemoteProtocolError

#: The error code of a SEND refused for a lower epoch than one the server has seen.
FENCED = "fenced"
#: The metadata key of a fence.
FENCE_FIELD = "fence"
#: Group names as the metaserver allows them: 1 to 128 characters of A-Z a-z 0-9 . _ -
GROUP_NAME_MAX = 128
GROUP_NAME = re.compile(r"[A-Za-z0-9._-]+")
#: Epochs are stored as unsigned 64-bit integers; this keeps them in msgpack's signed range too.
EPOCH_MAX = (1 << 63) - 1


def group_name_problem(value: Any) -> str | None:
    """Why ``value`` is not a server group name (the metaserver's rules), or None."""
    if type(value) is not str:
        return f"is of type {type(value).__name__}, not str"
    if not 0 < len(value) <= GROUP_NAME_MAX:
        return f"is {len(value)} characters, must be 1 to {GROUP_NAME_MAX}"
    if not GROUP_NAME.fullmatch(value):
        return f"{value[:60]!r} may use only A-Z a-z 0-9 . _ -"
    return None


@dataclass(frozen=True, slots=True)
class Fence:
    """A scheduler group and the epoch its sender holds as master."""

    group: str
    epoch: int

    def __post_init__(self) -> None:
        _check(self.group, self.epoch, LocalProtocolError)

    def as_metadata(self) -> dict[str, Any]:
        """The SEND metadata that carries this fence."""
        return {FENCE_FIELD: {"group": self.group, "epoch": self.epoch}}

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> Fence | None:
        """The fence a request's metadata carries (None: no fence).

        Anything but a map of exactly ``group`` and ``epoch`` with valid values
        is refused with ``RemoteProtocolError`` (``bad_metadata``) naming the field.
        """
        value = metadata.get(FENCE_FIELD)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise RemoteProtocolError(
                f"SEND: fence is of type {type(value).__name__}, not a map of group and epoch",
                code="bad_metadata",
                field=FENCE_FIELD,
            )
        for key in value:
            if key not in ("group", "epoch"):
                raise RemoteProtocolError(
                    f"SEND: unknown field {key!r} in fence (known: group, epoch)",
                    code="bad_metadata",
                    field=f"{FENCE_FIELD}.{key}",
                )
        group, epoch = _check(value.get("group"), value.get("epoch"), RemoteProtocolError)
        return cls(group, epoch)


def _check(group: Any, epoch: Any, error: type[ProtocolError]) -> tuple[str, int]:
    """``(group, epoch)`` if they make a fence; else ``error`` (``bad_metadata``) naming the field."""
    problem = group_name_problem(group)
    if problem is not None:
        raise error(f"SEND: fence.group {problem}", code="bad_metadata", field=f"{FENCE_FIELD}.group")
    if type(epoch) is not int or not 0 <= epoch <= EPOCH_MAX:
        shown = f"of type {type(epoch).__name__}" if type(epoch) is not int else str(epoch)
        raise error(
            f"SEND: fence.epoch is {shown}, must be an int from 0 to {EPOCH_MAX}",
            code="bad_metadata",
            field=f"{FENCE_FIELD}.epoch",
            limit=EPOCH_MAX,
        )
    return group, epoch


def fenced_error(fence: Fence, highest: int) -> RemoteProtocolError:
    """The refusal of a SEND whose epoch is below ``highest``, the highest seen for its group."""
    return RemoteProtocolError(
        f"SEND: scheduler group {fence.group!r} sent epoch {fence.epoch}, but this realtime server has "
        f"seen epoch {highest} of that group: the sender was replaced as master and must stop dispatching",
        code=FENCED,
        field=f"{FENCE_FIELD}.epoch",
        limit=highest,
    )


__all__ = ["EPOCH_MAX", "FENCED", "FENCE_FIELD", "GROUP_NAME_MAX", "Fence", "fenced_error", "group_name_problem"]
