"""The route cache: last answer per route, staleness, invalidation."""

from __future__ import annotations

import pytest

from delaymq.client.routecache import CachedRoute, RouteCache, RouteKey

T0 = 1_700_000_000_000


def test_unknown_route_needs_refresh_and_has_no_answer() -> None:
    cache = RouteCache()
    assert cache.get("delay") is None
    assert cache.needs_refresh("delay", T0)
    assert cache.next_refresh_ms() is None


def test_answer_goes_stale_after_the_refresh_interval() -> None:
    cache = RouteCache()
    assert cache.update("delay", CachedRoute(1, ("s1", "s2")), T0)
    assert cache.get("delay") == CachedRoute(1, ("s1", "s2"))
    assert not cache.needs_refresh("delay", T0 + 29_999)
    assert cache.needs_refresh("delay", T0 + 30_000)
    assert cache.refresh_due_ms("delay") == T0 + 30_000


def test_custom_refresh_interval() -> None:
    cache = RouteCache(refresh_interval_ms=5_000)
    cache.update("delay", CachedRoute(1, ("s1",)), T0)
    assert not cache.needs_refresh("delay", T0 + 4_999)
    assert cache.needs_refresh("delay", T0 + 5_000)


def test_update_says_whether_the_route_changed() -> None:
    cache = RouteCache()
    assert cache.update("delay", CachedRoute(1, ("s1",)), T0) is True
    assert cache.update("delay", CachedRoute(1, ("s1",)), T0 + 30_000) is False
    assert cache.update("delay", CachedRoute(2, ("s1", "s2")), T0 + 60_000) is True
    # A metaserver that restarted may count again from a lower version.
    assert cache.update("delay", CachedRoute(0, ("s3",)), T0 + 90_000) is True
    assert cache.get("delay") == CachedRoute(0, ("s3",))
    stats = cache.statistics()
    assert (stats.routes, stats.updates, stats.changes) == (1, 4, 3)


def test_unchanged_answer_still_counts_as_fresh() -> None:
    cache = RouteCache()
    cache.update("delay", CachedRoute(1, ("s1",)), T0)
    cache.update("delay", CachedRoute(1, ("s1",)), T0 + 30_000)
    assert not cache.needs_refresh("delay", T0 + 59_999)


def test_invalidate_forces_a_refresh_but_keeps_the_answer() -> None:
    cache = RouteCache()
    cache.update("delay", CachedRoute(1, ("s1",)), T0)
    assert cache.invalidate("delay") == 1
    assert cache.needs_refresh("delay", T0 + 1)
    assert cache.get("delay") == CachedRoute(1, ("s1",))  # stale routes beat none
    cache.update("delay", CachedRoute(1, ("s1",)), T0 + 2)
    assert not cache.needs_refresh("delay", T0 + 3)


def test_routes_per_subject_are_separate() -> None:
    cache = RouteCache()
    cache.update("realtime", CachedRoute(1, ("r1",)), T0, subject="orders")
    cache.update("realtime", CachedRoute(4, ("r2",)), T0 + 10_000, subject="payments")
    cache.update("delay", CachedRoute(1, ("s1",)), T0 + 20_000)
    assert cache.get("realtime", subject="orders") == CachedRoute(1, ("r1",))
    assert cache.get("realtime") is None
    assert cache.stale(T0 + 35_000) == (RouteKey("realtime", "orders"),)
    assert cache.next_refresh_ms() == T0 + 30_000

    assert cache.invalidate("realtime", subject="payments") == 1
    assert cache.stale(T0 + 1) == (RouteKey("realtime", "payments"),)
    assert cache.invalidate("realtime") == 2
    assert cache.invalidate() == 3
    assert cache.next_refresh_ms() == 0
    assert cache.statistics().invalidations == 6


def test_forget_drops_a_route() -> None:
    cache = RouteCache()
    cache.update("realtime", CachedRoute(1, ("r1",)), T0, subject="orders")
    cache.forget("realtime", subject="orders")
    assert cache.get("realtime", subject="orders") is None
    assert cache.statistics().routes == 0


def test_bad_arguments_name_the_field() -> None:
    with pytest.raises(ValueError, match="refresh_interval_ms 0 must be > 0"):
        RouteCache(refresh_interval_ms=0)
    with pytest.raises(ValueError, match="kind must be a non-empty str"):
        RouteCache().update("", CachedRoute(1, ()), T0)
