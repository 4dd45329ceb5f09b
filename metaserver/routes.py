"""Routes: which server groups a producer, consumer or scheduler should talk to.

The words of a route (server kinds, group states, route kinds, answers) are wire
vocabulary and live in ``delaymq.protocol.routes``; the rules here, which groups
each route shows, are the metaserver's own.

The registry keeps one *view*: every routable group that has a live master, with its kind,
state, master address and live slaves, sorted by group name. Each route query is
a filter over that view, so the answer to every query is a function of the view,
and the view's version changes exactly when the view does.
"""

from __future__ import annotations

from collections.abc import Mapping

from delaymq.metaserver.groups import Intervals, ServerGroup
from delaymq.metaserver.requests import Role
from delaymq.protocol.routes import GroupState, RouteAnswer, RoutedGroup, RouteKind, ServerKind

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


def select(route: RouteKind, view: tuple[RoutedGroup, ...], version: int) -> RouteAnswer:
    """Filter the view (already sorted by group name) for one route."""
    kind, states = _RULES[route]
    return RouteAnswer(
        version=version,
        groups=tuple(g for g in view if g.kind is kind and g.state in states),
    )


def build_view(
    groups: Mapping[str, ServerGroup], now: int, intervals: Intervals
) -> tuple[tuple[RoutedGroup, ...], int | None]:
    """The view at ``now``, and the time before which no eviction or failover can change it
    (None: none is pending)."""
    view = []
    next_expiry: int | None = None
    for name in sorted(groups):
        group = groups[name]
        expiry = _next_expiry(group, now, intervals)
        if expiry is not None:
            next_expiry = expiry if next_expiry is None else min(next_expiry, expiry)
        master = group.master()
        if master is None or not intervals.alive(group.servers[master], now):
            continue
        if not routable(group.kind, group.state):
            continue  # e.g. NRW: no answer shows it, so its changes bump nothing
        slaves = tuple(
            sorted(
                address
                for address, server in group.servers.items()
                if server.role is Role.SLAVE and intervals.alive(server, now)
            )
        )
        view.append(RoutedGroup(name, group.kind, group.state, master, slaves))
    return tuple(view), next_expiry


def _next_expiry(group: ServerGroup, now: int, intervals: Intervals) -> int | None:
    """The earliest eviction of a live server of ``group``, or failover of its master, still to come."""
    next_expiry: int | None = None
    for server in group.servers.values():
        if intervals.alive(server, now):
            expiry = server.last_heartbeat_ms + intervals.evict_after_ms
            next_expiry = expiry if next_expiry is None else min(next_expiry, expiry)
    master = group.master()
    if group.managed and master is not None and not group.waiting:
        failover = group.servers[master].last_heartbeat_ms + intervals.failover_after_ms
        if failover > now:
            next_expiry = failover if next_expiry is None else min(next_expiry, failover)
    return next_expiry


__all__ = ["build_view", "routable", "select"]
