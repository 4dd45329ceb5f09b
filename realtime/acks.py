"""ACK, NACK and CONSUMER_HEARTBEAT: a consumer settles ranges of its pull log and shows it is alive.

An ACK moves the consumer's acked position; a NACK without retry fields gives
its range back to the group at once (so does any NACK of a broadcast consumer:
a retry subject would reach every consumer of its group). A NACK with
``release`` gives it back too, but with ``attempts`` unchanged: the consumer
never handed those messages to its application (it is closing); without an
``end`` it runs to the end of the pull log and ends the consumer's pulls, waiting
or still on their way. A NACK asking for a retry or a dead letter claims its range and hands it
to ``Retries``. All answer once the change is durable (a checkpoint, and under
replication a progress record the slaves hold), so a crash or a failover never
forgets an ack or a release that was answered.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio

from delaymq.clock import Clock
from delaymq.net.limits import Limits
from delaymq.net.requests import Request
from delaymq.protocol.errors import RemoteProtocolError
from delaymq.realtime.consumers import Consumers
from delaymq.realtime.groups import ConsumerState, Groups, Share
from delaymq.realtime.parked import ParkedPulls
from delaymq.realtime.redelivery import RedeliverySweeper
from delaymq.realtime.requests import AckRequest, parse_ack, parse_heartbeat
from delaymq.realtime.retries import Retries


class AckHandler:
    """Answers ACK, NACK and CONSUMER_HEARTBEAT."""

    def __init__(
        self,
        *,
        consumers: Consumers,
        groups: Groups,
        retries: Retries,
        parked: ParkedPulls,
        sweeper: RedeliverySweeper,
        commit: Callable[[], Awaitable[None]],
        clock: Clock,
        limits: Limits,
    ) -> None:
        self._consumers = consumers
        self._groups = groups
        self._retries = retries
        self._parked = parked
        self._sweeper = sweeper
        self._commit_snapshot = commit
        #: Under sync replication: returns once the in-sync slaves hold the log appended so far.
        self.replicated: Callable[[], Awaitable[None]] | None = None
        self._clock = clock
        self._limits = limits

    async def ack(self, request: Request) -> dict[str, Any]:
        ack = parse_ack(request.metadata, self._limits)
        assert ack.end is not None  # required but for a release
        consumer = await self._consumers.get(ack.subject, ack.group, ack.consumer)
        acked = self._groups.ack(consumer, ack.start, ack.end, _names(ack))
        assert consumer is not None
        self._consumers.seen(consumer)
        await self.commit()
        return {"acked": acked}

    async def nack(self, request: Request) -> dict[str, Any]:
        nack = parse_ack(request.metadata, self._limits, nack=True)
        consumer = await self._consumers.get(nack.subject, nack.group, nack.consumer)
        names = _names(nack)
        now = self._clock.monotonic_ms()
        if nack.release:
            acked, shares = self._groups.release_range(consumer, nack.start, nack.end, now, names)
            if nack.end is None and consumer is not None:  # its waiting pulls answer empty
                self._parked.wake([consumer.subject])
        else:
            acked, shares = await self._give_back_or_retry(nack, consumer, now, names)
        self._sweeper.poke()
        self._parked.wake([share.subject for share in shares])
        await self.commit()
        return {"acked": acked}

    async def _give_back_or_retry(
        self, nack: AckRequest, consumer: ConsumerState | None, now: int, names: str
    ) -> tuple[int, list[Share]]:
        """A NACK's range back to the group at once, or re-scheduled as it asks; (acked, shares woken)."""
        assert nack.end is not None  # required but for a release
        if not nack.retry or consumer is None or consumer.broadcast:
            # Back to the group at once: asked so, or a broadcast consumer (its own
            # read position: a retry subject would reach every consumer of its group).
            return self._groups.nack(consumer, nack.start, nack.end, now, names)
        claim = self._groups.claim(consumer, nack.start, nack.end, now, names)
        shares: list[Share] = []
        if claim is not None:
            # Shielded (and bounded): a claim must end, whether the consumer
            # hangs up or not, or its messages would be held back for good.
            with trio.CancelScope(shield=True):
                shares = await self._retries.place(claim, nack)
        return consumer.acked, shares

    async def heartbeat(self, request: Request) -> dict[str, Any]:
        beat = parse_heartbeat(request.metadata, self._limits)
        now = self._clock.monotonic_ms()
        for subject in beat.subjects:
            state = self._consumers.find(subject, beat.group, beat.consumer)
            if state is not None:
                self._groups.touch(state, now)
        self._sweeper.poke()
        return {}

    async def commit(self) -> None:
        """Make the changes so far durable (and replicated), or refuse retryably."""
        try:
            await self._commit_snapshot()
            if self.replicated is not None:
                await self.replicated()
        except Exception as error:
            raise RemoteProtocolError(
                f"the server could not make the change durable ({type(error).__name__}: {error}); "
                "it is applied in memory and will be retried",
                code="unavailable",
            ) from error


def _names(request: AckRequest) -> str:
    """The consumer as a refusal names it."""
    return f"consumer {request.consumer!r} of group {request.group!r} on subject {request.subject!r}"


__all__ = ["AckHandler"]
