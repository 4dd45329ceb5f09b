"""A consumer's work with its realtime groups: follow the route, pull, heartbeat.

One task pulls from each realtime group of the ``consumer`` route (long polls,
so a message arrives as soon as it is stored), and one more the group's retry
subject there; a task re-reads the route and starts or stops pullers as groups
come and go; one sends CONSUMER_HEARTBEAT. A request that fails in a way a
failover explains marks its group as lost: the route is then asked again after
``ROUTE_RETRY_FIRST`` seconds, the wait doubling up to ``ROUTE_RETRY``, until the group
answers (a handover moves a group within a few tens of ms; a failover within about a
second). When the route moves a
group, a long poll still held by its old address is given up and the waits end
at once, so nothing waits on a master that is gone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import trio

from delaymq.client.delivery import ConsumerCore, ReceivedMessage
from delaymq.client.routes import RouteClient, RouteTable
from delaymq.clock import Clock
from delaymq.net.connection import TransportError
from delaymq.net.peers import Peers
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import PeerError, ProtocolError
from delaymq.protocol.routes import RouteAnswer, RouteKind

# The consumer's own logger: one name for everything a consumer does, as logging is configured.
log = logging.getLogger("delaymq.client.consumer")

#: Extra time a long poll's request is given beyond the poll itself.
POLL_MARGIN = 10.0
#: While a group's requests fail, the consumer route is asked again after this long at first
#: (seconds), then after twice as long each time, at most ``ROUTE_RETRY``: a failover (about a
#: second) is followed within a quarter of a second, at four route asks a second per consumer.
ROUTE_RETRY_FIRST = 0.05
ROUTE_RETRY = 0.25


def is_retryable(error: Exception) -> bool:
    """No answer, or a refusal another moment (or group) may not repeat."""
    return RouteTable.is_retryable(error)


class GroupPullers:
    """The pullers, route following and heartbeats of one consumer; what arrives goes to ``deliver``.

    ``settle`` is what the messages handed out call to be acked or nacked,
    ``want_settle`` asks for an ACK/NACK round, ``fail`` stops the consumer for
    good (a refusal retrying cannot fix). ``undelivered`` takes what arrived
    after ``stop`` (nobody reads it: it is released); ``finished`` is called once
    the consumer's ``limit`` is pulled (its last messages delivered).
    """

    def __init__(
        self,
        core: ConsumerCore,
        *,
        routes: RouteClient,
        peers: Peers,
        clock: Clock,
        heartbeat_interval: float,
        route_refresh: float,
        deliver: Callable[[list[ReceivedMessage]], None],
        settle: Callable[[ReceivedMessage, bool], Any],
        want_settle: Callable[[], None],
        fail: Callable[[BaseException], None],
        undelivered: Callable[[list[ReceivedMessage]], object],
        finished: Callable[[], None],
    ) -> None:
        self.core = core
        self.routes = routes
        self._peers = peers
        self._clock = clock
        self._heartbeat_ms = round(heartbeat_interval * 1000)
        self._route_ms = round(route_refresh * 1000)
        self._deliver = deliver
        self._settle = settle
        self._want_settle = want_settle
        self._fail = fail
        self._undelivered = undelivered
        self._finished = finished
        self.room = trio.lowlevel.ParkingLot()  # pullers waiting for flow-control room (or the limit's)
        self._route_wanted = trio.Event()
        self._pullers: dict[tuple[str, bool], trio.CancelScope] = {}  # (group, retry subject?)
        # The pull in flight (or its backoff) per puller: given up when its group moves.
        self._pull_attempts: dict[tuple[str, bool], trio.CancelScope] = {}
        self._lost: set[str] = set()  # groups whose last request failed: ask the route often
        self._moved = trio.Event()  # set (and replaced) when a group's address changes
        self._nursery: trio.Nursery | None = None
        self._stopped = False

    @property
    def moved(self) -> trio.Event:
        """Set when a group's address changes; a new one then stands for the next move."""
        return self._moved

    def start(self, nursery: trio.Nursery, answer: RouteAnswer) -> None:
        """Start pulling the groups of ``answer``, and following the route, in ``nursery``."""
        self._nursery = nursery
        self.apply_route(answer)
        nursery.start_soon(self._route_loop)

    def stop(self) -> None:
        """Pull no more (what is held stays held); route answers start no puller."""
        self._stopped = True
        for scope in self._pullers.values():
            scope.cancel()

    def answered(self, name: str) -> None:
        """A request to group ``name`` went through: it is where the route says."""
        self._lost.discard(name)

    # -- the route ------------------------------------------------------------

    def apply_route(self, answer: RouteAnswer) -> None:
        if self._stopped:
            return
        before = {name: link.address for name, link in self.core.links.items()}
        started, stopped = self.core.update_route((group.group, group.address) for group in answer.groups)
        self.follow_moves(before)
        for name in stopped:
            log.info("consumer %s: group %s left the route; stop pulling it", self.core.consumer_id, name)
            self._lost.discard(name)
            for lane in self.core.lanes:
                scope = self._pullers.pop((name, lane), None)
                if scope is not None:
                    scope.cancel()
        assert self._nursery is not None
        for name in started:
            for lane in self.core.lanes:
                scope = self._pullers[(name, lane)] = trio.CancelScope()
                self._nursery.start_soon(self._pull_loop, name, lane, scope)
        if not self.core.links or not any(link.active for link in self.core.links.values()):
            log.warning("consumer %s: no realtime group serves consumers yet; waiting", self.core.consumer_id)

    def follow_moves(self, before: dict[str, str]) -> list[str]:
        """Groups whose address changed (a new master): give up what waits on the old one; returns them."""
        moved = [
            name for name, address in before.items()
            if (link := self.core.links.get(name)) is not None and link.address != address
        ]  # fmt: skip
        if not moved:
            return moved
        for name in moved:
            log.info("consumer %s: group %s moved from %s to %s; pulls, acks and heartbeats follow",
                     self.core.consumer_id, name, before[name], self.core.links[name].address)  # fmt: skip
            for backoff in self.core.links[name].backoffs:
                backoff.reset()  # a new master: try it soon (it may still be opening), not at the old pace
            for lane in self.core.lanes:
                attempt = self._pull_attempts.get((name, lane))
                if attempt is not None:
                    attempt.cancel()
        self._moved.set()
        self._moved = trio.Event()
        if self.core.has_pending():
            self._want_settle()
        return moved

    def request_failed(self, name: str, error: Exception) -> None:
        """A request to group ``name`` failed: if the group may have moved, ask the route (soon, and again)."""
        link = self.core.links.get(name)
        if is_retryable(error) and link is not None and link.active:
            self._lost.add(name)
            self._route_wanted.set()

    async def _route_loop(self) -> None:
        interval = self._route_ms / 1000
        slowest = min(ROUTE_RETRY, interval)
        pace = min(slowest, ROUTE_RETRY_FIRST)  # the least time between two asks now: doubles while a group is lost
        asked = trio.current_time()  # by open_consumer
        while True:
            with trio.move_on_at(asked + (pace if self._lost else interval)):
                await self._route_wanted.wait()
            await trio.sleep_until(asked + pace)
            pace = min(slowest, pace * 2) if self._lost else min(slowest, ROUTE_RETRY_FIRST)
            self._route_wanted = trio.Event()
            if self._lost:  # where is the group now? (the held answer is not stale yet)
                self.routes.table.cache.invalidate(RouteKind.CONSUMER)
            asked = trio.current_time()
            try:
                self.apply_route(await self.routes.groups(RouteKind.CONSUMER))
            except (TransportError, ProtocolError, LookupError) as error:
                log.info("consumer %s: route refresh failed: %s", self.core.consumer_id, error)

    # -- pulling and heartbeats -----------------------------------------------

    async def _pull_loop(self, name: str, retry: bool, scope: trio.CancelScope) -> None:
        """Pull one subject (``retry``: the group's retry subject) from one group, at its current address."""
        core = self.core
        timeout = core.poll_timeout_ms / 1000 + POLL_MARGIN
        lane = (name, retry)
        with scope:
            while True:
                request = core.pull_request(name, retry=retry)
                if request is None:
                    if core.limit.reached:
                        self._finished()
                        return
                    await self.room.park()
                    continue
                address = core.links[name].address
                # Given up (cancelled) when the group moves: then pull at once at its new address.
                with trio.CancelScope() as attempt:
                    self._pull_attempts[lane] = attempt
                    try:
                        frame = await self._peers.call(address, Command.PULL, request, timeout=timeout)
                        messages = core.accept_pull(
                            name, frame.metadata, frame.body, self._clock.now_ms(), self._settle, retry=retry
                        )
                    except (PeerError, TransportError, ProtocolError) as error:
                        if not is_retryable(error):
                            self._fail(error)
                            return
                        await self._pull_failed(name, retry, request, address, error)
                        continue
                    finally:
                        if self._pull_attempts.get(lane) is attempt:
                            del self._pull_attempts[lane]
                if attempt.cancelled_caught:
                    core.pull_abandoned(name, retry=retry)
                    self._limit_freed()
                    continue  # the group moved while this pull waited on its old address
                self._lost.discard(name)
                self._limit_freed()
                if messages and self._stopped:
                    # After ``stop`` (its cancel came after this answer had arrived) nobody
                    # reads them: they go back to the group as they were.
                    self._undelivered(messages)
                elif messages:
                    self._deliver(messages)
                if core.has_pending():
                    self._want_settle()
                if core.limit.reached:
                    self._finished()
                    return

    def _limit_freed(self) -> None:
        """A pull ended: what it reserved of the consumer's limit and did not get is free for other lanes."""
        if self.core.limit.total is not None:
            self.room.unpark_all()

    async def _pull_failed(
        self, name: str, retry: bool, request: dict[str, Any], address: str, error: Exception
    ) -> None:
        """Log a pull worth retrying, ask where the group is, and wait out its backoff."""
        core = self.core
        # A refusal is an answer: nothing was handed out; a lost answer may have handed some out.
        backoff = core.pull_failed(name, retry=retry, refused=isinstance(error, PeerError))
        self._limit_freed()
        first = core.links[name].backoffs[retry].failures == 1  # later ones at debug
        log.log(logging.INFO if first else logging.DEBUG,
                "consumer %s: pull of %s from group %s at %s failed (%s); retry in %d ms",
                core.consumer_id, request["subject"], name, address, error, backoff)  # fmt: skip
        self.request_failed(name, error)
        await trio.sleep(backoff / 1000)

    async def heartbeat_loop(self) -> None:
        """Send CONSUMER_HEARTBEAT to every group this consumer holds or pulls messages from."""
        core = self.core
        while True:
            await trio.sleep_until(trio.current_time() + self._heartbeat_ms / 1000)

            async def beat(name: str, address: str) -> None:
                try:
                    await self._peers.call(address, Command.CONSUMER_HEARTBEAT, core.heartbeat_metadata())
                except (PeerError, TransportError) as error:
                    log.debug("consumer %s: heartbeat to %s at %s failed: %s", core.consumer_id, name, address, error)
                    self.request_failed(name, error)
                else:
                    self._lost.discard(name)

            async with trio.open_nursery() as nursery:
                for name, address in core.heartbeat_targets():
                    nursery.start_soon(beat, name, address)


__all__ = ["POLL_MARGIN", "ROUTE_RETRY", "GroupPullers", "is_retryable"]
