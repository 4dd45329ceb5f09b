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


__all__ = ["routable", "select"]
