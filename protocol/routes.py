"""The metaserver's wire vocabulary: server kinds, group states, route kinds and route answers.

Shared by the metaserver (which answers with them), the servers that register
with it and the clients that ask it for routes, so none of those imports the
metaserver's own code. Which groups a route shows is the metaserver's policy
(``delaymq.metaserver.routes``); what the words mean on the wire is here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

#: The error code of a heartbeat from a server the metaserver does not know.
REGISTER_FIRST = "register_first"
#: The error code of a heartbeat or registration from a master another server superseded.
SUPERSEDED = "superseded"
#: The error code of a registration of a member id that is live at another address, from another run.
MEMBER_TAKEN = "member_taken"
#: The roles the metaserver assigns in a replicated (managed) group's heartbeat answers.
ROLE_MASTER = "master"
ROLE_SLAVE = "slave"


class ServerKind(enum.StrEnum):
    """What a server group does: holds delayed messages, or serves consumers."""

    SCHEDULER = "scheduler"
    REALTIME = "realtime"


class GroupState(enum.StrEnum):
    """Read-write, read-only (no new messages in, consumers still served), or neither."""

    RW = "RW"
    R = "R"
    NRW = "NRW"


class RouteKind(enum.StrEnum):
    """Who is asking, which decides the groups it may use."""

    DELAYED_PRODUCER = "delayed-producer"
    IMMEDIATE_PRODUCER = "immediate-producer"
    CONSUMER = "consumer"
    SCHEDULER_DELIVERY = "scheduler-delivery"


@dataclass(frozen=True, slots=True)
class RoutedGroup:
    """One group as a route shows it: where its master is and its live slaves."""

    group: str
    kind: ServerKind
    state: GroupState
    address: str
    slaves: tuple[str, ...]

    def as_dict(self) -> dict[str, Any]:
        """Plain, msgpack-able form for the wire."""
        return {
            "group": self.group,
            "kind": self.kind.value,
            "state": self.state.value,
            "address": self.address,
            "slaves": list(self.slaves),
        }


@dataclass(frozen=True, slots=True)
class RouteAnswer:
    """The metaserver's answer to a ROUTE question: the groups, and the registry version they were taken at."""

    version: int
    groups: tuple[RoutedGroup, ...]

    def as_dict(self) -> dict[str, Any]:
        """Plain, msgpack-able form for the wire."""
        return {"version": self.version, "groups": [g.as_dict() for g in self.groups]}


__all__ = [
    "MEMBER_TAKEN",
    "REGISTER_FIRST",
    "ROLE_MASTER",
    "ROLE_SLAVE",
    "SUPERSEDED",
    "GroupState",
    "RouteAnswer",
    "RouteKind",
    "RoutedGroup",
    "ServerKind",
]
