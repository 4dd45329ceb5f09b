"""PULL: hand a consumer the next entries of its share, waiting (long poll) when there are none.

Per request the work is one read of consume-log entries (``pick``: given-back
entries first, then new ones, by tag bitmask) and one read of the records: from
memory when they were stored lately (``RECENT_BYTES``), else in a worker thread
(``run_blocking``) (a record that does not check, in a damaged message log, is
left out and logged). With nothing to hand out the pull parks on its subject
until an entry arrives or is given back, or its ``timeout_ms`` passes; a
consumer in a long poll counts as alive. Entries a scheduler sent ahead of their
``deliver_at`` are not handed out before it, or before ``ahead_ms`` ahead of it when
the PULL asks for that (the consumer then holds them until due: fewer PULLs, one per
SEND rather than one per release tick); the pull parks until then. What is
handed out goes into the consumer's pull log before the answer (so after a crash
recovery knows it) and is due back by the ack timeout. A consumer that releases
everything it holds (a NACK with ``release`` and no ``end``: it is closing) ends
its waiting pulls with nothing, and a PULL it sent before that arrives after, on
the connection its pulls came on, is answered with nothing at once.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import trio

from delaymq.clock import Clock
from delaymq.net.limits import Limits
from delaymq.net.requests import Request
from delaymq.protocol.histogram import LatencyHistogram
from delaymq.protocol.records import RECORD_TIMES, tags_mask
from delaymq.realtime.consumelog import ConsumeLog
from delaymq.realtime.consumers import Consumers
from delaymq.realtime.delivery import EntriesNotHeld, Picked, pick, read_intact, read_recent_records, read_window
from delaymq.realtime.groups import ConsumerState, Groups
from delaymq.realtime.index import Indexer
from delaymq.realtime.parked import ParkedPulls
from delaymq.realtime.redelivery import RedeliverySweeper
from delaymq.realtime.requests import PullRequest, parse_pull
from delaymq.replication.roles import NotMaster
from delaymq.storage.log import SegmentedLog
from delaymq.storage.threads import RunBlocking

log = logging.getLogger(__name__)

#: The newest message-log bytes kept in memory, so a PULL of records stored within
#: the last seconds (most of them) reads no file and needs no worker thread.
RECENT_BYTES = 8 << 20


class PullHandler:
    """Answers PULL."""

    def __init__(
        self,
        *,
        consumers: Consumers,
        groups: Groups,
        indexer: Indexer,
        parked: ParkedPulls,
        sweeper: RedeliverySweeper,
        message_log: SegmentedLog,
        clock: Clock,
        limits: Limits,
        run_blocking: RunBlocking,
    ) -> None:
        self._consumers = consumers
        self._run_blocking = run_blocking
        self._groups = groups
        self._indexer = indexer
        self._parked = parked
        self._sweeper = sweeper
        self._log = message_log
        message_log.keep_recent(RECENT_BYTES)
        self._clock = clock
        self._limits = limits
        self.pulls = 0  # PULL requests answered
        self.delivered = 0  # records handed out, redeliveries included
        #: Handed out - due of each record, in ms (due: ``deliver_at``, or ``created_at`` for
        #: an immediate message; redeliveries included): the "handed to the consumer" stage.
        self.lateness = LatencyHistogram()
        #: Under sync replication: returns once the hand-outs are replicated (a checkpoint).
        self.handed_out: Callable[[], Awaitable[None]] | None = None
        #: Why this handler hands nothing out any more (its master session ended), or None.
        self.closed: str | None = None

    def close(self, reason: str) -> None:
        """Hand nothing out from now on: parked pulls wake and are refused (``not_master``)."""
        self.closed = reason
        self._parked.wake_all()

    async def handle(self, request: Request) -> tuple[dict[str, Any], bytes]:
        pull = parse_pull(request.metadata, self._limits)
        consumer = await self._consumers.get(pull.subject, pull.group, pull.consumer, create=pull)
        assert consumer is not None
        if self._groups.pulled_after_leaving(consumer, request.connection):
            # Sent before its consumer released all it had and closed: no sign of life, and
            # nothing handed out (it would be held, for nobody, until the ack timeout).
            self.pulls += 1
            return {"pull_start": consumer.length, "count": 0, "acked": consumer.acked}, b""
        self._consumers.seen(consumer)
        consumer.waiting += 1  # a consumer in a long poll is alive
        try:
            picked = await self._wait_for_entries(pull, consumer)
        finally:
            consumer.waiting -= 1
        self.pulls += 1
        now = self._clock.monotonic_ms()
        if not picked:
            self._groups.touch(consumer, now)
            return {"pull_start": consumer.length, "count": 0, "acked": consumer.acked}, b""
        return await self._hand_out(pull, consumer, picked, now)

    async def _wait_for_entries(self, pull: PullRequest, consumer: ConsumerState) -> list[Picked]:
        """Pick entries for ``consumer``, parked until some arrive or are due, or ``pull`` times out."""
        groups = self._groups
        mask = tags_mask(pull.tags) if pull.tags else 0
        deadline = trio.current_time() + pull.timeout_ms / 1000
        subject = pull.subject
        # Never more than half the ack timeout ahead: a hand-out's ack timeout starts at once.
        ahead_ms = min(pull.ahead_ms, groups.ack_timeout_ms // 2)
        left = consumer.left
        while True:
            if self.closed is not None:
                raise NotMaster(f"PULL: {self.closed}; ask the metaserver")
            # Before picking (which moves the share, and the hand-out follows with no wait):
            # a pull whose connection is gone, or whose consumer released all it had since
            # (it is closing), hands nothing out.
            await trio.lowlevel.checkpoint_if_cancelled()
            if consumer.left != left:
                return []
            consume_log = self._indexer.consume_log(subject)
            # What is held until ``ahead_ms`` from now may go: the consumer holds it until due.
            now_ms = self._clock.now_ms() + ahead_ms
            try:
                picked, more, held_until = pick(
                    consume_log, groups, consumer.share, pull.max, pull.max_bytes, mask, now_ms
                )
            except EntriesNotHeld as missing:  # a consumer that lags: its entries from the file
                assert consume_log is not None
                await self._read_entries(consume_log, missing.sequence)
                continue
            if picked or trio.current_time() >= deadline:
                return picked
            if more:
                await trio.lowlevel.checkpoint()
                continue
            wake = deadline
            if held_until is not None:  # the next entry is not due: pick again when it is
                wake = min(deadline, trio.current_time() + (held_until - now_ms) / 1000)
            await self._parked.wait(subject, wake)

    async def _hand_out(
        self, pull: PullRequest, consumer: ConsumerState, picked: list[Picked], now: int
    ) -> tuple[dict[str, Any], bytes]:
        """Record ``picked`` in the consumer's pull log, then answer with their records."""
        groups = self._groups
        # In the pull log before the answer: after a crash, recovery knows what went out.
        start = self._consumers.record_pull(consumer, picked, now)
        self._sweeper.poke()
        recent = read_recent_records(self._log, picked)
        bad: list[Picked]
        if recent is not None:
            kept, body, bad = picked, recent, []
        else:
            kept, body, bad = await self._run_blocking(partial(read_intact, self._log, picked))
        if bad:
            log.warning(
                "realtime: group %r on %r: %d record(s) at message-log offsets %s do not check "
                "(the message log is damaged there); the group goes on without them",
                pull.group,
                pull.subject,
                len(bad),
                ", ".join(str(item.offset) for item in bad[:10]) + (" ..." if len(bad) > 10 else ""),
            )
            # That hand-out never reaches the consumer: settled, the intact ones handed anew.
            groups.settle(consumer, start, start + len(picked))
            if not kept:
                return {"pull_start": consumer.length, "count": 0, "acked": consumer.acked}, b""
            start = self._consumers.record_pull(consumer, kept, now)
        if self.handed_out is not None:
            await self.handed_out()
        self.delivered += len(kept)
        self.lateness.record_many(_lateness(body, kept, self._clock.now_ms()))
        return {"pull_start": start, "count": len(kept), "acked": consumer.acked}, body

    async def _read_entries(self, consume_log: ConsumeLog, start: int) -> None:
        """Read consume-log entries from ``start`` in a worker thread and hold them for ``pick``."""
        await read_window(consume_log, start, run_blocking=self._run_blocking, hold=self._indexer.hold)


def _lateness(body: bytes, kept: list[Picked], now: int) -> list[int]:
    """``now`` - due of each record of ``body`` (the records of ``kept``, end to end)."""
    lateness: list[int] = []
    position = 0
    times = RECORD_TIMES.unpack_from
    for item in kept:
        deliver_at, created_at = times(body, position)[5:]
        lateness.append(now - (deliver_at or created_at))
        position += item.size
    return lateness


__all__ = ["PullHandler"]
