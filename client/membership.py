"""What the metaserver's heartbeat answer says of a server's place in its replicated group:
its role, the group's epoch and master, a pending handover, and (to the master) the
in-sync set it recorded. Sans-IO: parsed from the answer's metadata."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from delaymq.protocol.errors import RemoteProtocolError
from delaymq.protocol.routes import ROLE_MASTER, ROLE_SLAVE


@dataclass(frozen=True, slots=True)
class MembershipView:
    """What the metaserver last said of this server's place in its managed group."""

    role: str | None  # "master" or "slave"; None before an answer, or in a group that is not managed
    epoch: int  # the group's epoch (0 before one is known)
    master_address: str | None  # the group's master
    handover_to: str | None  # to the master and the target: the server to hand over to, while one is pending


def membership_fields(metadata: Mapping[str, Any]) -> tuple[str | None, int, str | None]:
    """The managed-group fields of a heartbeat answer: role, epoch, handover target."""
    role = metadata.get("role")
    epoch = metadata.get("epoch", 0)
    handover_to = metadata.get("handover_to")
    if role is not None and role not in (ROLE_MASTER, ROLE_SLAVE):
        raise RemoteProtocolError(f"heartbeat answer has unknown role {role!r}", code="bad_metadata", field="role")
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
        raise RemoteProtocolError("heartbeat answer 'epoch' is not an integer", code="bad_metadata", field="epoch")
    if handover_to is not None and not isinstance(handover_to, str):
        raise RemoteProtocolError(
            "heartbeat answer 'handover_to' is not a string", code="bad_metadata", field="handover_to"
        )
    return role, epoch, handover_to


def recorded_in_sync(metadata: Mapping[str, Any]) -> tuple[str, ...] | None:
    """The master's ``in_sync`` of a heartbeat answer: the set the metaserver recorded."""
    in_sync = metadata.get("in_sync")
    if in_sync is None:
        return None
    if not isinstance(in_sync, list) or not all(isinstance(address, str) for address in in_sync):
        raise RemoteProtocolError(
            "heartbeat answer 'in_sync' is not a list of addresses", code="bad_metadata", field="in_sync"
        )
    return tuple(in_sync)


__all__ = ["MembershipView", "membership_fields", "recorded_in_sync"]
