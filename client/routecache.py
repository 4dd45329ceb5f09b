"""The client's last answer from the metaserver, per route.

A route is a kind (which servers: e.g. delayed sends, immediate sends,
consuming) and, for kinds that route per subject, a subject. The cache holds the
last answer of each route and says when it is stale: ``refresh_interval_ms``
after it was fetched, or at once after ``invalidate`` (a send to one of its
groups failed, so the routes may have moved). A stale answer is still served by
``get``: old routes beat no routes while the metaserver is slow or down.
Sans-IO: the time is passed in, nothing here reads a clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class RouteKey(NamedTuple):
    kind: str
    subject: str = ""  # "" for kinds not routed per subject


@dataclass(frozen=True, slots=True)
class CachedRoute:
    """What the cache holds of one route: the metaserver's answer as group names only (addresses live elsewhere)."""

    version: int
    groups: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", tuple(self.groups))


@dataclass(frozen=True, slots=True)
class RouteCacheStatistics:
    routes: int
    updates: int  # answers fed to update()
    changes: int  # answers that differed from the one held
    invalidations: int


@dataclass(slots=True)
class _Cached:
    answer: CachedRoute
    fetched_at_ms: int
    invalid: bool = False


class RouteCache:
    """Last answer per route, and when each must be fetched again."""

    def __init__(self, *, refresh_interval_ms: int = 30_000) -> None:
        if refresh_interval_ms <= 0:
            raise ValueError(f"refresh_interval_ms {refresh_interval_ms} must be > 0")
        self.refresh_interval_ms = refresh_interval_ms
        self._routes: dict[RouteKey, _Cached] = {}
        self._updates = 0
        self._changes = 0
        self._invalidations = 0

    def get(self, kind: str, *, subject: str = "") -> CachedRoute | None:
        """The last answer for the route (stale or not); None if never fetched."""
        cached = self._routes.get(RouteKey(kind, subject))
        return cached.answer if cached is not None else None

    def update(self, kind: str, answer: CachedRoute, now_ms: int, *, subject: str = "") -> bool:
        """Store a fresh answer; True when it differs from the one held (new version or groups).

        Any different version replaces the held one, older too: a restarted metaserver
        may count again from 0, and refreshes of one route are not run concurrently.
        """
        if not kind:
            raise ValueError("kind must be a non-empty str")
        key = RouteKey(kind, subject)
        held = self._routes.get(key)
        changed = held is None or held.answer != answer
        self._routes[key] = _Cached(answer, now_ms)
        self._updates += 1
        if changed:
            self._changes += 1
        return changed

    def refresh_due_ms(self, kind: str, *, subject: str = "") -> int:
        """Epoch ms from which the route needs fetching; 0 if never fetched or invalidated."""
        cached = self._routes.get(RouteKey(kind, subject))
        return 0 if cached is None else self._due(cached)

    def needs_refresh(self, kind: str, now_ms: int, *, subject: str = "") -> bool:
        return self.refresh_due_ms(kind, subject=subject) <= now_ms

    def stale(self, now_ms: int) -> tuple[RouteKey, ...]:
        """Every held route that needs fetching at ``now_ms``, most overdue first."""
        due = [(self._due(c), key) for key, c in self._routes.items()]
        return tuple(key for at, key in sorted(due) if at <= now_ms)

    def next_refresh_ms(self) -> int | None:
        """When the earliest held route falls due (for a refresher to sleep until); None if empty."""
        return min((self._due(c) for c in self._routes.values()), default=None)

    def invalidate(self, kind: str | None = None, *, subject: str | None = None) -> int:
        """Mark routes stale so their next use refreshes them; returns how many.

        ``None`` matches any: ``invalidate()`` is every route, ``invalidate(kind)`` every
        subject of that kind, ``invalidate(kind, subject=s)`` one route.
        """
        count = 0
        for key, cached in self._routes.items():
            if (kind is None or key.kind == kind) and (subject is None or key.subject == subject):
                cached.invalid = True
                count += 1
        self._invalidations += count
        return count

    def forget(self, kind: str, *, subject: str = "") -> None:
        """Drop a route no longer used (a subject the client stopped sending to)."""
        self._routes.pop(RouteKey(kind, subject), None)

    def _due(self, cached: _Cached) -> int:
        return 0 if cached.invalid else cached.fetched_at_ms + self.refresh_interval_ms

    def statistics(self) -> RouteCacheStatistics:
        return RouteCacheStatistics(
            routes=len(self._routes),
            updates=self._updates,
            changes=self._changes,
            invalidations=self._invalidations,
        )


__all__ = ["CachedRoute", "RouteCache", "RouteCacheStatistics", "RouteKey"]
