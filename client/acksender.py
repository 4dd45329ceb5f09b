"""A consumer's acks and nacks on the way to its realtime groups.

Settled messages are marked in the ``ConsumerCore``; ``AckSender`` sends what is
marked in rounds, at most one per ``SETTLE_INTERVAL``, each group's requests
(one ``[start, end)`` range each) on the way together, so the server answers
them from one checkpoint; a closing consumer's releases to the end of its pull
logs go (and are answered) before the rest. What a round could not send stays
queued and goes again after ``SETTLE_BACKOFF``, or at once when a group moves to
a new master.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import trio

from delaymq.client.acks import Settlement, SettleRequest
from delaymq.client.delivery import SETTLE_BACKOFF, SETTLE_CONCURRENCY, SETTLE_INTERVAL, ConsumerCore
from delaymq.net.connection import TransportError
from delaymq.net.peers import Peers
from delaymq.protocol.backoff import BackoffRun
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import PeerError

# The consumer's own logger: one name for everything a consumer does, as logging is configured.
log = logging.getLogger("delaymq.client.consumer")

#: Error codes an ACK/NACK may get that retrying cannot fix: the ranges are dropped.
_GIVE_UP_CODES = frozenset({"unknown_pull", "bad_value", "bad_request", "limit"})


def send_failure(settlement: Settlement, error: Exception, *, again: bool = False) -> bool:
    """Log a failed ACK/NACK (``again``: not the first in a row, at debug); True when it is worth sending again."""
    if isinstance(error, PeerError) and error.code in _GIVE_UP_CODES:
        log.warning("group %s refused acks of consumer: %s (dropped)", settlement.group, error)
        return False
    log.log(logging.DEBUG if again else logging.INFO, "acks to group %s at %s failed, will retry: %s",
            settlement.group, settlement.address, error)  # fmt: skip
    return True


class AckSender:
    """Sends what a ``ConsumerCore`` has settled; told of its groups' moves and failures by callbacks.

    ``moved()`` is the event set when a group's address changes (replaced after
    each move); ``answered(group)`` and ``failed(group, error)`` report how a
    group's request went, so the consumer knows which groups to look up again.
    """

    def __init__(
        self,
        core: ConsumerCore,
        *,
        moved: Callable[[], trio.Event],
        answered: Callable[[str], None],
        failed: Callable[[str, Exception], None],
    ) -> None:
        self.core = core
        self._moved = moved
        self._answered = answered
        self._failed = failed
        self._wanted = trio.Event()
        #: Held by a round: a flush or the close waits for the round in flight instead of racing it.
        self.lock = trio.Lock()
        self._backoff = BackoffRun(SETTLE_BACKOFF, random=core.random)  # reset when a round sends all

    def want(self) -> None:
        """Something was settled: send it in the next round."""
        self._wanted.set()

    async def run(self, peers: Peers) -> None:
        """Send rounds over ``peers`` as settlements come, until cancelled."""
        backoff = self._backoff
        started = -math.inf
        while True:
            await self._wanted.wait()
            moved = self._moved()
            # One round per SETTLE_INTERVAL: what is settled meanwhile goes with it (a
            # group's move ends the wait: its acks go to the new master at once).
            with trio.move_on_at(started + SETTLE_INTERVAL):
                await moved.wait()
            self._wanted = trio.Event()
            started = trio.current_time()
            moved = self._moved()
            async with self.lock:
                done = await self.send_round(peers)
            if done:
                backoff.reset()
                continue
            # What did not go stays queued: again after a backoff, or at once at a group's new address.
            with trio.move_on_after(backoff.next_delay_ms() / 1000):
                await moved.wait()
            self._wanted.set()

    async def flush(self, peers: Peers) -> bool:
        """Send every ack and nack not sent yet; False if some could not be (they stay queued)."""
        async with self.lock:
            return await self.send_round(peers)

    async def send_round(self, peers: Peers) -> bool:
        """Send what is pending to every group at once; True if all of it went.

        A closing consumer's releases to the end of its pull logs go first, and the rest
        for a group only once that group answered them: until then a PULL of the consumer
        waiting there (or still on its way) would take back what the rest gives back, and
        hand it out again for nobody to read. What waits on a release that failed stays
        queued with it.
        """
        leaving: list[Settlement] = []
        rest: list[Settlement] = []
        for settlement in self.core.take_pending():
            alone, others = settlement.split_leaving()
            if alone is not None:
                leaving.append(alone)
            if others.requests():
                rest.append(others)
        try:
            failed = await self._send_all(leaving, peers) if leaving else set()
        except BaseException:  # cancelled: the rest was not sent, and stays queued
            self._put_back(rest)
            raise
        self._put_back([settlement for settlement in rest if settlement.group in failed])
        failed |= await self._send_all([settlement for settlement in rest if settlement.group not in failed], peers)
        return not failed

    async def _send_all(self, settlements: list[Settlement], peers: Peers) -> set[str]:
        """Send ``settlements`` at once; returns the groups of those that did not all go."""
        failed: set[str] = set()

        async def send(settlement: Settlement) -> None:
            if not await self._send_settlement(settlement, peers):
                failed.add(settlement.group)

        async with trio.open_nursery() as nursery:
            for settlement in settlements:
                nursery.start_soon(send, settlement)
        return failed

    def _put_back(self, settlements: list[Settlement]) -> None:
        for settlement in settlements:
            self.core.settle_failed(settlement, settlement.requests())

    async def _send_settlement(self, settlement: Settlement, peers: Peers) -> bool:
        """Send a settlement's requests (one range each) together, so the server answers them
        from one checkpoint rather than one each; True if every one went (or was refused for good)."""
        core = self.core
        unsent = settlement.requests()
        again: list[SettleRequest] = []  # failed in a way worth sending again
        errors: list[Exception] = []
        limit = trio.Semaphore(SETTLE_CONCURRENCY)

        async def send(request: SettleRequest) -> None:
            async with limit:
                command = Command.ACK if request.ack else Command.NACK
                try:
                    await peers.call(settlement.address, command, core.settle_metadata(settlement, request))
                except (PeerError, TransportError) as error:
                    if send_failure(settlement, error, again=self._backoff.failures > 0 or bool(errors)):
                        again.append(request)
                        errors.append(error)
                else:
                    self._answered(settlement.group)
                unsent.remove(request)

        try:
            async with trio.open_nursery() as nursery:
                for request in list(unsent):
                    nursery.start_soon(send, request)
        except BaseException:  # cancelled: what was not confirmed is sent again (repeats are harmless)
            core.settle_failed(settlement, unsent + again)
            raise
        if again:
            core.settle_failed(settlement, again)
            self._failed(settlement.group, errors[0])
            return False
        return True


__all__ = ["AckSender", "send_failure"]
