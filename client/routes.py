"""The clients' route layer: which group a request goes to, and what a failure means.

``RouteTable`` (``delaymq.client.routetable``) is the sans-IO core: the
metaserver's answers, a ``GroupSelector`` per route, one ``LatencyFaultTable``
shared by all routes, and every decision: when to ask the metaserver, which
metaserver, which group next, whether an error means "try another group" or
"give up"; a ``CallPlan`` there holds one call's.
``RouteClient``, here, only does the I/O around them (trio; the blocking
clients run it on their loop thread). The errors are in ``delaymq.client.routeerrors``.

A request is retried on another group when it got no answer (``PeerUnavailable``,
``RequestTimeout``) or was refused with a code in ``RETRY_CODES`` (the group is
read-only, not the master, unavailable...); after such a failure the group is
avoided and the route is fetched again before the next attempt. Any other error
answer (``limit``, ``bad_value``, ``bad_request``...) is about the request
itself: it is raised at once, since another group would refuse it too. When
every metaserver is down the last answer is used however old, and the
metaserver is asked again no sooner than ``meta_retry_ms`` later.

A call given ``retry_for`` (the producer's ``send_timeout``) rides out an
outage instead: it tries up to ``attempts`` different groups in a round (other
groups first), and when a round has failed it waits a backoff with jitter
(``CALL_BACKOFF``: 100 ms doubling to 500 ms, never less than half of that) and
starts another round, always with the same request (so the same message ids),
until ``retry_for`` seconds on the client's clock have passed; then it raises
``CallTimedOut`` saying what was tried. A route no metaserver has answered yet,
or one whose groups left it while the call was trying them, is waited for the
same way; a route a metaserver answered with no group when the call began is
raised at once (``NoRouteError``), as are refusals about the request itself.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import trio

from delaymq.client.faults import AvoidancePolicy
from delaymq.client.routecache import RouteKey
from delaymq.client.routeerrors import Attempt, CallFailed, CallTimedOut, NoRouteError, RouteError
from delaymq.client.routetable import (
    CALL_BACKOFF,
    RETRY_CODES,
    CallPlan,
    RouteClientStatistics,
    RouteTable,
    check_retry_for,
    parse_route_answer,
)
from delaymq.clock import Clock
from delaymq.net.connection import TransportError
from delaymq.net.peers import AsyncCaller
from delaymq.protocol.backoff import Backoff, RandomSource
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import PeerError, ProtocolError
from delaymq.protocol.frames import Frame
from delaymq.protocol.routes import RouteAnswer

#: ``open_peers`` options of the clients' own connections: no wait of the transport's before
#: redialling an address whose last connect failed. Every client retry loop paces itself
#: (``CALL_BACKOFF``; the consumer's pulls, acks, heartbeats), and the transport's wait (growing
#: to seconds) stacked under it made a client reach a restarted server seconds after it was back.
CLIENT_PEERS_OPTIONS: dict[str, float] = {"backoff_initial": 0.0, "backoff_max": 0.0}


def meta_addresses(meta: str | Sequence[str]) -> list[str]:
    """One address, a comma-separated list, or a sequence of addresses, as a list."""
    if isinstance(meta, str):
        addresses = [part.strip() for part in meta.split(",") if part.strip()]
    else:
        addresses = [str(part).strip() for part in meta]
    if not addresses:
        raise ValueError("meta: at least one metaserver address (HOST:PORT) is needed")
    return addresses


_REFRESH_ERRORS = (TransportError, ProtocolError)


class RouteClient:
    """Routed requests from trio code: cached routes, round robin, avoidance, retries."""

    def __init__(
        self,
        peers: AsyncCaller,
        meta_addresses: Sequence[str],
        *,
        clock: Clock,
        refresh_interval_ms: int = 30_000,
        policy: AvoidancePolicy | None = None,
        meta_retry_ms: int = 1_000,
        meta_timeout: float = 5.0,
        random: RandomSource | None = None,
    ) -> None:
        self.table = RouteTable(
            meta_addresses, refresh_interval_ms=refresh_interval_ms, policy=policy, meta_retry_ms=meta_retry_ms,
            random=random,
        )  # fmt: skip
        self._peers = peers
        self._clock = clock
        self._meta_timeout = meta_timeout
        self._refreshing: dict[RouteKey, trio.Event] = {}

    async def groups(self, route: str, subject: str | None = None) -> RouteAnswer:
        """The route's groups with their addresses, fetched if stale (old ones if no metaserver answers)."""
        key = self.table.key(route, subject)
        await self._refresh_if_due(key)
        answer = self.table.answer(key)
        if answer is None:
            raise self.table.no_route(key)
        return answer

    async def call(
        self,
        route: str,
        command: int,
        metadata: dict[str, Any] | None = None,
        body: bytes = b"",
        *,
        subject: str | None = None,
        attempts: int = 3,
        timeout: float | None = None,
        retry_for: float | None = None,
        retry_for_name: str = "retry_for",
        backoff: Backoff = CALL_BACKOFF,
    ) -> Frame:
        """Send a request to a group of the route, retrying failures on other groups.

        ``timeout`` bounds each try. Without ``retry_for`` at most ``attempts``
        tries are made; with it (seconds) the call goes on in rounds of up to
        ``attempts`` groups with ``backoff`` between them until that long has
        passed (``retry_for_name`` is how its error names the limit). Raises
        ``NoRouteError`` (no group), ``CallFailed`` (``CallTimedOut`` with
        ``retry_for``: every attempt failed) or the ``PeerError`` of a refusal
        that is about the request itself.
        """
        key = self.table.key(route, subject)
        plan = self.table.start_call(
            key, command, attempts, now_ms=self._clock.monotonic_ms(), retry_for=retry_for,
            retry_for_name=retry_for_name, backoff=backoff,
        )  # fmt: skip
        while True:
            wait_ms = plan.ready_at_ms - self._clock.monotonic_ms()
            if wait_ms > 0:
                await self._clock.sleep_ms(wait_ms)
            # A metaserver that does not answer must not hold the call past its deadline.
            left = plan.timeout_for(None, self._clock.monotonic_ms())
            with trio.move_on_after(math.inf if left is None else left):
                await self._refresh_if_due(key)
            now = self._clock.monotonic_ms()
            group = plan.next_group(now)
            if group is None:
                continue
            try:
                frame = await self._peers.call(
                    group.address, command, metadata, body, timeout=plan.timeout_for(timeout, now)
                )
            except (PeerError, TransportError) as error:
                plan.failed(group, error, self._clock.monotonic_ms())
            else:
                plan.succeeded(group, self._clock.monotonic_ms())
                return frame

    async def _refresh_if_due(self, key: RouteKey) -> None:
        while True:
            if not self.table.needs_fetch(key, self._clock.monotonic_ms()):
                return
            running = self._refreshing.get(key)
            if running is None:
                break
            await running.wait()  # another task is fetching this route
        done = self._refreshing[key] = trio.Event()
        try:
            failures: list[tuple[str, Exception]] = []
            for address, metadata in self.table.fetch_plan(key):
                try:
                    frame = await self._peers.call(address, Command.ROUTE, metadata, timeout=self._meta_timeout)
                    self.table.accept(key, address, frame.metadata, self._clock.monotonic_ms())
                    return
                except _REFRESH_ERRORS as error:
                    if self.table.question_refused(error):
                        raise
                    failures.append((address, error))
            self.table.fetch_failed(key, failures, self._clock.monotonic_ms())
        finally:
            del self._refreshing[key]
            done.set()

    def statistics(self) -> RouteClientStatistics:
        return self.table.statistics()


__all__ = [
    "CALL_BACKOFF",
    "CLIENT_PEERS_OPTIONS",
    "RETRY_CODES",
    "Attempt",
    "CallFailed",
    "CallPlan",
    "CallTimedOut",
    "NoRouteError",
    "RouteClient",
    "RouteClientStatistics",
    "RouteError",
    "RouteTable",
    "check_retry_for",
    "meta_addresses",
    "parse_route_answer",
]
