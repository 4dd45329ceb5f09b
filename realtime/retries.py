"""Nacked messages sent back through a scheduler, or to the dead letters.

A NACK with ``delay_ms`` re-schedules its messages: they are re-addressed to the
group's retry subject ``%retry%<group>%<subject>`` (same id, ``attempts`` + 1,
``deliver_at`` = now + delay; see ``delaymq.protocol.subjects``) and handed to a
scheduler (route ``delayed-producer``, through the metaserver of
``meta_address``), which delivers them back to a realtime group when due. A
NACK with ``dead`` appends them to this server's own log as
``%dead%<group>%<subject>`` at once (and so does a delay of 0, as a retry). The
range counts as settled only once the scheduler (or the log) took them; with no
scheduler to take them they go back to the group at once.
"""

from __future__ import annotations

import logging
from functools import partial

import trio

from delaymq.client.routes import RouteClient, RouteError
from delaymq.clock import Clock
from delaymq.net.connection import TransportError
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import ProtocolError
from delaymq.protocol.records import MAX_ATTEMPTS, decode_batch, encode_message, scan_batch
from delaymq.protocol.routes import RouteKind
from delaymq.protocol.subjects import dead_subject, retry_subject
from delaymq.realtime.delivery import claimed_entries, read_records
from delaymq.realtime.groups import Claim, Groups, Share
from delaymq.realtime.index import REPLAY_LIMITS, Indexer
from delaymq.realtime.requests import AckRequest
from delaymq.realtime.send import SendHandler
from delaymq.storage.log import SegmentedLog
from delaymq.storage.threads import RunBlocking

log = logging.getLogger(__name__)

#: How long a NACK may wait for a scheduler to take its retries (all attempts),
#: and one attempt; past it the messages go back to the group at once.
SCHEDULE_DEADLINE_S = 8.0
SCHEDULE_TIMEOUT_S = 4.0


def readdress(records: bytes, *, subject: str, deliver_at: int) -> bytes:
    """The records again, sent to ``subject`` at ``deliver_at`` with ``attempts`` + 1; ids kept."""
    out = []
    for message in decode_batch(records, REPLAY_LIMITS):
        out.append(
            encode_message(
                message.id,
                subject,
                tags=message.tags,
                properties=message.properties or None,
                body=message.body,
                deliver_at=deliver_at,
                created_at=message.created_at,
                attempts=min(message.attempts + 1, MAX_ATTEMPTS),
                limits=REPLAY_LIMITS,
            )
        )
    return b"".join(out)


class Retries:
    """Places the messages of a NACK's claim: with a scheduler, or in this server's log."""

    def __init__(
        self,
        *,
        groups: Groups,
        indexer: Indexer,
        message_log: SegmentedLog,
        sender: SendHandler,
        clock: Clock,
        run_blocking: RunBlocking,
    ) -> None:
        self._groups = groups
        self._run_blocking = run_blocking
        self._indexer = indexer
        self._log = message_log
        self._sender = sender
        self._clock = clock
        #: Where retries go: a scheduler of the ``delayed-producer`` route (set up with a meta_address).
        self.scheduler_routes: RouteClient | None = None
        self.scheduled = 0  # nacked messages a scheduler took, to come back after their delay
        self.stored = 0  # nacked messages retried at once (delay 0), appended here
        self.dead_letters = 0  # nacked messages of a last attempt, appended to their dead-letter subject
        self.given_back = 0  # nacked messages no scheduler took: given back to the group at once

    async def place(self, claim: Claim, nack: AckRequest) -> list[Share]:
        """Re-address a claim's messages and place them (scheduler or log); ends the claim."""
        done = False
        count = len(claim.entries)
        try:
            records = await self._read_claimed(claim)
            now = self._clock.now_ms()
            if nack.dead:
                subject, deliver_at = dead_subject(nack.group, nack.subject), now
            else:
                assert nack.delay_ms is not None
                subject, deliver_at = retry_subject(nack.group, nack.subject), now + nack.delay_ms
            body = readdress(records, subject=subject, deliver_at=deliver_at)
            if nack.dead or deliver_at <= now:
                await self._sender.append(scan_batch(body, REPLAY_LIMITS))
                done = True
                if nack.dead:
                    self.dead_letters += count
                    log.info("realtime: %d message(s) of group %s to %s after their last attempt",
                             count, nack.group, subject)  # fmt: skip
                else:
                    self.stored += count
            else:
                done = await self._schedule(body, count, subject)
                if done:
                    self.scheduled += count
                else:
                    self.given_back += count
        finally:
            shares = self._groups.release(claim, done=done)
        return shares

    async def _read_claimed(self, claim: Claim) -> bytes:
        """The claimed records as their consumer got them (``attempts`` with redeliveries).

        Entries no longer in memory are read in a worker thread, as for a PULL that lags."""
        consume_log = self._indexer.consume_log(claim.consumer.subject)
        assert consume_log is not None  # the consumer was handed entries of it
        picked = await claimed_entries(
            consume_log, claim.entries, run_blocking=self._run_blocking, hold=self._indexer.hold
        )
        return await self._run_blocking(partial(read_records, self._log, picked))

    async def _schedule(self, body: bytes, count: int, subject: str) -> bool:
        """Hand retries to a scheduler; False (logged) when none took them."""
        routes = self.scheduler_routes
        if routes is None:
            log.warning("realtime: no scheduler (no meta_address) for %d retr%s on %s; given back at once",
                        count, "y" if count == 1 else "ies", subject)  # fmt: skip
            return False
        try:
            with trio.fail_after(SCHEDULE_DEADLINE_S):
                frame = await routes.call(
                    RouteKind.DELAYED_PRODUCER, Command.SCHEDULE, {}, body, attempts=3, timeout=SCHEDULE_TIMEOUT_S
                )
        except (RouteError, ProtocolError, TransportError, trio.TooSlowError) as error:
            log.warning("realtime: no scheduler took %d retr%s on %s (%s); given back at once",
                        count, "y" if count == 1 else "ies", subject, str(error) or type(error).__name__)  # fmt: skip
            return False
        results = frame.metadata.get("results")
        if not isinstance(results, list) or len(results) != count:
            log.warning("realtime: scheduler answered SCHEDULE of %d retries with results %r; given back at once",
                        count, results)  # fmt: skip
            return False
        return True  # "scheduled", or "duplicate": it holds them already


__all__ = ["SCHEDULE_DEADLINE_S", "SCHEDULE_TIMEOUT_S", "Retries", "readdress"]
