"""Routes: which server groups a producer, consumer or scheduler should talk to.

The registry keeps one *view*: every routable group that has a live master, with its kind,
state, master address and live slaves, sorted by group name. Each route query is
a filter over that view, so the answer to every query is a function of the view,
and the view's version changes exactly when the view does.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


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


# (kind of group, states in which it takes part) per route.
_RULES: dict[RouteKind, tuple[ServerKind, frozenset[GroupState]]] = {
    RouteKind.DELAYED_PRODUCER: (ServerKind.SCHEDULER, frozenset({GroupState.RW})),
    RouteKind.IMMEDIATE_PRODUCER: (ServerKind.REALTIME, frozenset({GroupState.RW})),
    RouteKind.CONSUMER: (ServerKind.REALTIME, frozenset({GroupState.RW, GroupState.R})),
    # Every RW realtime group serves every subject for now; the subject is taken
    # so per-subject routing can come without changing the question.
    RouteKind.SCHEDULER_DELIVERY: (ServerKind.REALTIME, frozenset({GroupState.RW})),
}


def routable(kind: ServerKind, state: GroupState) -> bool:
    """Whether some route shows a group of this kind in this state (NRW: none does)."""
    return any(kind is k and state in states for k, states in _RULES.values())


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
    """The groups for one route, and the registry version they were taken at."""

    version: int
    groups: tuple[RoutedGroup, ...]

    def as_dict(self) -> dict[str, Any]:
        """Plain, msgpack-able form for the wire."""
        return {"version": self.version, "groups": [g.as_dict() for g in self.groups]}


def select(route: RouteKind, view: tuple[RoutedGroup, ...], version: int) -> RouteAnswer:
    """Filter the view (already sorted by group name) for one route."""
    kind, states = _RULES[route]
    return RouteAnswer(
        version=version,
        groups=tuple(g for g in view if g.kind is kind and g.state in states),
    )


__all__ = ["GroupState", "RouteAnswer", "RouteKind", "RoutedGroup", "ServerKind", "routable", "select"]
