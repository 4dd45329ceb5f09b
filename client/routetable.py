"""The clients' route table: every route decision, sans-IO.

``RouteTable`` holds the metaserver's answers (``RouteCache`` for staleness, the
groups with their addresses beside it), a ``GroupSelector`` per route and one
``LatencyFaultTable`` shared by all routes (a broken group is broken for every
route), and decides when to ask the metaserver, which metaserver, which group
next, and whether an error means "try another group" or "give up". A
``CallPlan`` holds one call's decisions over it: without a deadline ``attempts``
tries; with one (``retry_for``, the producer's ``send_timeout``) rounds of up to
``attempts`` groups, untried groups first, ``CALL_BACKOFF`` between rounds, until
the deadline. Not thread-safe; ``RouteClient`` (``delaymq.client.routes``) does
the I/O around them.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from delaymq.client.faults import AvoidancePolicy, FaultTableStatistics, LatencyFaultTable
from delaymq.client.routecache import CachedRoute, RouteCache, RouteCacheStatistics, RouteKey
from delaymq.client.routeerrors import Attempt, CallFailed, CallTimedOut, NoRouteError
from delaymq.client.selector import GroupSelector
from delaymq.net.auth import FORBIDDEN, UNAUTHORIZED
from delaymq.net.connection import TransportError
from delaymq.net.tls import TLS_REQUIRED
from delaymq.protocol.backoff import Backoff, BackoffRun, RandomSource
from delaymq.protocol.commands import command_name
from delaymq.protocol.errors import PeerError, RemoteProtocolError
from delaymq.protocol.routes import GroupState, RouteAnswer, RoutedGroup, RouteKind, ServerKind

#: Error codes that mean "this group will not take it now; another may".
RETRY_CODES = frozenset(
    {"read_only", "not_master", "unavailable", "overloaded", "shutting_down", "internal", "rate_limited"}
)

#: The waits between rounds of a call with ``retry_for``: 100 ms doubling to 500 ms, each at least half its
#: ceiling. The cap bounds how long after a restarted server is back a send waiting for it goes through.
CALL_BACKOFF = Backoff(initial_ms=100, maximum_ms=500, multiplier=2.0, jitter="equal")

_WANTED = {
    RouteKind.DELAYED_PRODUCER: "no scheduler group in RW serves delayed producers",
    RouteKind.IMMEDIATE_PRODUCER: "no realtime group in RW serves immediate producers",
    RouteKind.CONSUMER: "no realtime group in RW or R serves consumers",
    RouteKind.SCHEDULER_DELIVERY: "no realtime group in RW takes deliveries of subject {subject!r}",
}


@dataclass(frozen=True, slots=True)
class RouteClientStatistics:
    routes: RouteCacheStatistics
    faults: FaultTableStatistics
    fetches: int  # route answers received from a metaserver
    fetch_failures: int  # refreshes that no metaserver answered
    stale_served: int  # refreshes that failed while an older answer was held
    calls: int
    retries: int  # attempts after the first
    refused: int  # attempts refused with a RETRY_CODES code
    unanswered: int  # attempts that got no answer


def parse_route_answer(metadata: Mapping[str, Any]) -> RouteAnswer | int:
    """A ROUTE answer's groups, or just its version when it says ``unchanged``."""
    version = metadata.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise RemoteProtocolError("route answer has no integer 'version'", code="bad_metadata", field="version")
    if metadata.get("unchanged") is True:
        return version
    raw = metadata.get("groups")
    if not isinstance(raw, list):
        raise RemoteProtocolError("route answer 'groups' is not a list", code="bad_metadata", field="groups")
    groups = []
    for i, item in enumerate(raw):
        where = f"groups[{i}]"
        if not isinstance(item, dict):
            raise RemoteProtocolError(f"route answer {where} is not a map", code="bad_metadata", field=where)
        try:
            name, address, slaves = item["group"], item["address"], item["slaves"]
            kind, state = ServerKind(item["kind"]), GroupState(item["state"])
        except (KeyError, ValueError, TypeError) as error:
            raise RemoteProtocolError(
                f"route answer {where} is malformed: {type(error).__name__} {error}", code="bad_metadata", field=where
            ) from None
        if not (isinstance(name, str) and name and isinstance(address, str) and address):
            raise RemoteProtocolError(
                f"route answer {where} needs string 'group' and 'address'", code="bad_metadata", field=where
            )
        if not isinstance(slaves, list) or not all(isinstance(s, str) for s in slaves):
            raise RemoteProtocolError(
                f"route answer {where}.slaves is not a list of strings", code="bad_metadata", field=f"{where}.slaves"
            )
        groups.append(RoutedGroup(name, kind, state, address, tuple(slaves)))
    return RouteAnswer(version, tuple(groups))


@dataclass(slots=True)
class _Held:
    answer: RouteAnswer
    source: str  # the metaserver that answered: known_version is only meaningful to it


class RouteTable:
    """Everything a client knows and decides about routes. Sans-IO; not thread-safe."""

    def __init__(
        self,
        meta_addresses: Sequence[str],
        *,
        refresh_interval_ms: int = 30_000,
        policy: AvoidancePolicy | None = None,
        meta_retry_ms: int = 1_000,
        random: RandomSource | None = None,
    ) -> None:
        if isinstance(meta_addresses, str):
            meta_addresses = [meta_addresses]
        if not meta_addresses:
            raise ValueError("meta_addresses: at least one metaserver address is needed")
        self.meta_addresses = tuple(meta_addresses)
        self.cache = RouteCache(refresh_interval_ms=refresh_interval_ms)
        self.faults = LatencyFaultTable(policy)
        self.meta_retry_ms = meta_retry_ms
        self.random = random  # the jitter of call backoffs; None: random.random
        self._held: dict[RouteKey, _Held] = {}
        self._selectors: dict[RouteKey, GroupSelector] = {}
        self._retry_at: dict[RouteKey, int] = {}  # after a failed refresh: not before this
        self._last_failure: dict[RouteKey, str] = {}
        self._meta_first = 0  # the metaserver that answered last is asked first
        self._fetches = 0
        self._fetch_failures = 0
        self._stale_served = 0
        self._calls = 0
        self._retries = 0
        self._refused = 0
        self._unanswered = 0

    # -- fetching routes -------------------------------------------------------

    @staticmethod
    def key(route: str, subject: str | None = None) -> RouteKey:
        """The cache key of a route, checked (``ValueError`` names the bad argument)."""
        try:
            kind = RouteKind(route)
        except ValueError:
            allowed = ", ".join(repr(k.value) for k in RouteKind)
            raise ValueError(f"route {route!r} is not one of {allowed}") from None
        if kind is RouteKind.SCHEDULER_DELIVERY and not subject:
            raise ValueError("subject: the scheduler-delivery route needs a subject")
        if subject is not None and not isinstance(subject, str):
            raise ValueError(f"subject must be a str, not {type(subject).__name__}")
        return RouteKey(kind.value, subject or "")

    def needs_fetch(self, key: RouteKey, now_ms: int) -> bool:
        return self.cache.needs_refresh(key.kind, now_ms, subject=key.subject) and now_ms >= self._retry_at.get(key, 0)

    def fetch_plan(self, key: RouteKey) -> list[tuple[str, dict[str, Any]]]:
        """(metaserver, ROUTE metadata) in the order to try them."""
        n = len(self.meta_addresses)
        held = self._held.get(key)
        plan = []
        for i in range(n):
            address = self.meta_addresses[(self._meta_first + i) % n]
            metadata: dict[str, Any] = {"route": key.kind}
            if key.subject:
                metadata["subject"] = key.subject
            if held is not None and held.source == address:
                metadata["known_version"] = held.answer.version
            plan.append((address, metadata))
        return plan

    def accept(self, key: RouteKey, address: str, metadata: Mapping[str, Any], now_ms: int) -> RouteAnswer:
        """Take a metaserver's ROUTE answer; ``RemoteProtocolError`` if it is malformed."""
        parsed = parse_route_answer(metadata)
        held = self._held.get(key)
        if isinstance(parsed, int):
            if held is None or held.source != address or held.answer.version != parsed:
                raise RemoteProtocolError(
                    f"metaserver {address} answered 'unchanged' for version {parsed}, which this client "
                    "did not get from it",
                    code="bad_metadata",
                    field="unchanged",
                )
            answer = held.answer
        else:
            answer = parsed
        self._held[key] = _Held(answer, address)
        names = tuple(group.group for group in answer.groups)
        self.cache.update(key.kind, CachedRoute(answer.version, names), now_ms, subject=key.subject)
        selector = self._selectors.get(key)
        if selector is None:
            self._selectors[key] = GroupSelector(names, faults=self.faults)
        else:
            selector.update_groups(names)
        self.faults.retain(g.group for held in self._held.values() for g in held.answer.groups)
        self._retry_at.pop(key, None)
        if not names:
            # Nothing to send to: ask again after meta_retry_ms, not the refresh interval, so a
            # group that registers (again, say after it was evicted while down) is used at once.
            self.cache.invalidate(key.kind, subject=key.subject)
            self._retry_at[key] = now_ms + self.meta_retry_ms
        self._last_failure.pop(key, None)
        self._meta_first = self.meta_addresses.index(address) if address in self.meta_addresses else 0
        self._fetches += 1
        return answer

    @staticmethod
    def question_refused(error: Exception) -> bool:
        """Whether a failed ROUTE is refused as asked (a bad subject; plaintext to a TLS metaserver; a token
        refused): no metaserver will answer it."""
        return isinstance(error, PeerError) and error.code in ("bad_request", TLS_REQUIRED, UNAUTHORIZED, FORBIDDEN)

    def fetch_failed(self, key: RouteKey, failures: Sequence[tuple[str, Exception]], now_ms: int) -> None:
        """No metaserver answered: keep what is held, ask again after ``meta_retry_ms``."""
        self._fetch_failures += 1
        if key in self._held:
            self._stale_served += 1
        self._retry_at[key] = now_ms + self.meta_retry_ms
        self._last_failure[key] = "; ".join(f"metaserver {address}: {error}" for address, error in failures)

    def answer(self, key: RouteKey) -> RouteAnswer | None:
        """The answer held for a route, however old; None if no metaserver ever answered."""
        held = self._held.get(key)
        return held.answer if held is not None else None

    def no_route(self, key: RouteKey) -> NoRouteError:
        """The error for a route with nothing to send to, saying what the metaserver said."""
        wanted = _WANTED[RouteKind(key.kind)].format(subject=key.subject)
        held = self._held.get(key)
        parts = [wanted]
        if held is not None:
            parts.append(
                f"metaserver {held.source} answered route {key.kind!r} (version {held.answer.version}) "
                f"with {len(held.answer.groups)} groups"
            )
        failure = self._last_failure.get(key)
        if failure:
            parts.append(("no metaserver answered since: " if held else "no metaserver answered: ") + failure)
        return NoRouteError("; ".join(parts))

    # -- sending ---------------------------------------------------------------

    def start_call(
        self,
        key: RouteKey,
        command: int,
        attempts: int,
        *,
        now_ms: int = 0,
        retry_for: float | None = None,
        retry_for_name: str = "retry_for",
        backoff: Backoff = CALL_BACKOFF,
    ) -> CallPlan:
        """The plan of one call: ``attempts`` tries in all, or, with ``retry_for`` (seconds), per round."""
        if attempts < 1:
            raise ValueError(f"attempts is {attempts}, must be at least 1")
        deadline_ms = None
        if retry_for is not None:
            check_retry_for(retry_for, retry_for_name)
            deadline_ms = now_ms + math.ceil(retry_for * 1000)
        self._calls += 1
        return CallPlan(
            self, key, command, attempts, now_ms=now_ms, deadline_ms=deadline_ms, retry_for_name=retry_for_name,
            backoff=BackoffRun(backoff, random=self.random),
        )  # fmt: skip

    def route_unknown(self, key: RouteKey) -> bool:
        """Whether no metaserver has answered for the route yet (it may: one may be restarting)."""
        return key not in self._held

    def pick(self, key: RouteKey, now_ms: int, *, exclude: Collection[str] = ()) -> RoutedGroup:
        """The group for the next attempt; ``NoRouteError`` if the route holds none."""
        held = self._held.get(key)
        selector = self._selectors.get(key)
        if held is None or selector is None or not held.answer.groups:
            raise self.no_route(key)
        name = selector.pick(now_ms, exclude=exclude)
        return next(group for group in held.answer.groups if group.group == name)

    def answered(self, group: str, latency_ms: int, now_ms: int) -> None:
        self.faults.record_latency(group, max(0, latency_ms), now_ms)

    def failed(self, key: RouteKey, group: str, now_ms: int) -> None:
        """The group failed a request: avoid it, and fetch the route before the next try."""
        self.faults.record_failure(group, now_ms)
        self.cache.invalidate(key.kind, subject=key.subject)

    @staticmethod
    def is_retryable(error: Exception) -> bool:
        """True for errors another group may not have: no answer, or a RETRY_CODES refusal."""
        if isinstance(error, PeerError):
            return error.code in RETRY_CODES
        return isinstance(error, TransportError | RemoteProtocolError)

    def statistics(self) -> RouteClientStatistics:
        return RouteClientStatistics(
            routes=self.cache.statistics(),
            faults=self.faults.statistics(),
            fetches=self._fetches,
            fetch_failures=self._fetch_failures,
            stale_served=self._stale_served,
            calls=self._calls,
            retries=self._retries,
            refused=self._refused,
            unanswered=self._unanswered,
        )


class CallPlan:
    """The decisions of one routed call: which group next, when, and what each outcome means.

    A driver loops: wait until ``ready_at_ms``, refresh the route if due,
    ``next_group`` (None: no group known yet, loop again), send with
    ``timeout_for``, then ``succeeded`` or ``failed`` (which re-raises an error
    that ends the call). Without a deadline ``next_group`` raises ``CallFailed``
    once ``attempts`` tries have failed. With one, ``attempts`` caps a round:
    after a failure an untried group is tried at once; once the round is over
    (``attempts`` tries, or every group tried) ``ready_at_ms`` moves a backoff
    ahead and a new round starts; ``CallTimedOut`` ends it when the next try
    could not start before the deadline.
    """

    def __init__(
        self,
        table: RouteTable,
        key: RouteKey,
        command: int,
        attempts: int,
        *,
        now_ms: int = 0,
        deadline_ms: int | None = None,
        retry_for_name: str = "retry_for",
        backoff: BackoffRun | None = None,
    ) -> None:
        self._table = table
        self._key = key
        self._command = command
        self._attempts = attempts
        self._tried: list[Attempt] = []
        self._started_ms = now_ms  # of the attempt in flight
        self._begun_ms = now_ms  # of the call
        self._deadline_ms = deadline_ms
        self._retry_for_name = retry_for_name
        self._backoff = backoff if backoff is not None else BackoffRun(CALL_BACKOFF, random=table.random)
        self._round: set[str] = set()  # groups tried in this round
        self._round_tries = 0
        self.rounds = 1
        #: Epoch ms before which the next attempt must not start (a backoff between rounds).
        self.ready_at_ms = now_ms

    def next_group(self, now_ms: int) -> RoutedGroup | None:
        """The group to try next; None when the route is not known yet (wait ``ready_at_ms``, loop)."""
        tried = self._tried
        if self._deadline_ms is None:
            if len(tried) >= self._attempts:
                detail = "; ".join(str(attempt) for attempt in tried)
                raise CallFailed(
                    f"{command_name(self._command)} on route {self._key.kind!r} failed {len(tried)} times: {detail}",
                    tried,
                )
            exclude: Collection[str] = {a.group for a in tried}
        else:
            if now_ms >= self._deadline_ms:
                raise self._timed_out(now_ms)
            exclude = self._round
        try:
            group = self._table.pick(self._key, now_ms, exclude=exclude)
        except NoRouteError as error:
            # With a deadline, wait for a route no metaserver answered yet, or one whose groups left it
            # while this call was trying them (evicted while down: it may register again); a route
            # answered empty from the start is a cluster with nothing to serve it, said at once.
            if self._deadline_ms is None or not (tried or self._table.route_unknown(self._key)):
                raise
            self._record(Attempt("", ", ".join(self._table.meta_addresses), error), now_ms, end_round=True)
            return None
        if tried:
            self._table._retries += 1
        self._started_ms = now_ms
        return group

    def timeout_for(self, timeout: float | None, now_ms: int) -> float | None:
        """The timeout of the attempt starting now: ``timeout``, but never past the deadline."""
        if self._deadline_ms is None:
            return timeout
        left = max(0.001, (self._deadline_ms - now_ms) / 1000)
        return left if timeout is None else min(timeout, left)

    def succeeded(self, group: RoutedGroup, now_ms: int) -> None:
        self._table.answered(group.group, now_ms - self._started_ms, now_ms)

    def failed(self, group: RoutedGroup, error: Exception, now_ms: int) -> None:
        """Record a failed attempt, or re-raise ``error`` when no other group would do better."""
        table = self._table
        if not table.is_retryable(error):
            table.answered(group.group, now_ms - self._started_ms, now_ms)  # it answered, promptly or not
            raise error
        if isinstance(error, PeerError):
            table._refused += 1
        else:
            table._unanswered += 1
        table.failed(self._key, group.group, now_ms)
        self._round.add(group.group)
        self._round_tries += 1
        answer = table.answer(self._key)
        untried = answer is not None and any(g.group not in self._round for g in answer.groups)
        # A rate limit says how long until the same request fits (``retry_after_ms``): no round sooner.
        wait_ms = error.retry_after_ms if isinstance(error, PeerError) else None
        self._record(Attempt(group.group, group.address, error), now_ms, end_round=not untried, at_least_ms=wait_ms)

    def _record(self, attempt: Attempt, now_ms: int, *, end_round: bool, at_least_ms: int | None = None) -> None:
        self._tried.append(attempt)
        if self._deadline_ms is None:
            return
        if end_round or self._round_tries >= self._attempts:
            self.ready_at_ms = now_ms + max(self._backoff.next_delay_ms(), at_least_ms or 0)
            self._round.clear()
            self._round_tries = 0
            self.rounds += 1
        else:
            self.ready_at_ms = now_ms  # another group, at once
        if self.ready_at_ms >= self._deadline_ms:
            raise self._timed_out(now_ms)

    def _timed_out(self, now_ms: int) -> CallTimedOut:
        tried = self._tried
        elapsed = now_ms - self._begun_ms
        assert self._deadline_ms is not None
        limit = (self._deadline_ms - self._begun_ms) / 1000
        by_place: dict[tuple[str, str], list[Attempt]] = {}
        for attempt in tried:
            by_place.setdefault((attempt.group, attempt.address), []).append(attempt)
        places = "; ".join(
            f"{'route lookup' if not group else f'group {group} at {address}'}: "
            f"{len(attempts)} attempt{'s' if len(attempts) != 1 else ''}, last error: {attempts[-1].error}"
            for (group, address), attempts in by_place.items()
        )
        rounds = self.rounds - 1 if self.ready_at_ms > now_ms else self.rounds  # a round not begun is not counted
        return CallTimedOut(
            f"{command_name(self._command)} on route {self._key.kind!r} gave up after {elapsed / 1000:.1f} s "
            f"({self._retry_for_name} is {limit:g} s): {len(tried)} failed attempts in {rounds} "
            f"round{'s' if rounds != 1 else ''} with backoff; {places}",
            tried,
            rounds=rounds,
            elapsed_ms=elapsed,
        )


def check_retry_for(value: object, name: str = "retry_for") -> float:
    """``value`` if it is a usable time limit in seconds (finite, more than 0); else ``ValueError`` naming ``name``."""
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} is {value!r}; it must be a number of seconds more than 0")
    return float(value)


__all__ = [
    "CALL_BACKOFF",
    "RETRY_CODES",
    "CallPlan",
    "RouteClientStatistics",
    "RouteTable",
    "check_retry_for",
    "parse_route_answer",
]
