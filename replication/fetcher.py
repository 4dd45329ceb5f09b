"""ReplicaFetcher: the slave's side of log shipping.

A loop of FETCH calls to the master (``delaymq.replication.wire``): each asks from the
slave's durable log end (acknowledging everything before), appends the bytes it gets
at the same offsets, byte for byte, fsyncs them, keeps the master's epoch history,
and hands the owner the side journal's entries and the master's tick. The next FETCH
goes out at once, so under sync replication a SCHEDULE waits one slave fsync and two
hops. Catch-up from far behind is the same loop with full answers.

When the master says the slave holds a tail it never had (``truncate_to``), the owner
cuts it (``ReplicaOwner.cut_back``: the log and what was derived from it). A master
that cannot be reached, or refuses, is tried again with a growing backoff, logged once
per outage; the owner's role loop replaces the fetcher when the metaserver names
another master.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import trio

from delaymq.clock import Clock
from delaymq.net.connection import TransportError
from delaymq.net.peers import AsyncCaller
from delaymq.protocol.backoff import Backoff, BackoffRun
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import PeerError, ProtocolError
from delaymq.replication.epochs import EpochHistory
from delaymq.replication.wire import OFFSET_DELETED, FetchAnswer, FetchRequest
from delaymq.storage.errors import StorageError
from delaymq.storage.log import SegmentedLog
from delaymq.storage.state import StateStore
from delaymq.storage.threads import RunBlocking

log = logging.getLogger(__name__)

DEFAULT_FETCH_BYTES = 4 << 20
#: How long a FETCH may take: the master holds it up to its tick interval, so this is generous.
DEFAULT_FETCH_TIMEOUT = 10.0


class ReplicaOwner(Protocol):
    """What the fetcher needs of the server it fetches for."""

    async def take_journal(self, entries: list[bytes], *, reset: bool) -> None:
        """Persist the side journal's entries (``reset``: a full snapshot) before the next FETCH."""

    def take_tick(self, tick: bytes, *, master_now_ms: int, master_durable_end: int) -> None:
        """The master's tick as of its answer."""

    async def cut_back(self, offset: int) -> None:
        """Cut the log (and what was derived from it) back to ``offset``."""

    def agreed(self, offset: int) -> None:
        """The master answered without cutting: the log below ``offset`` is the master's too,
        so what is derived from it may be (until then a tail the master never had may be
        there: a deposed master's)."""


@dataclass(frozen=True, slots=True)
class FetcherStatistics:
    master: str
    epoch: int
    fetches: int
    bytes_received: int
    failures: int
    cut_bytes: int
    master_durable_end: int
    last_answer_ms: int | None  # monotonic


class ReplicaFetcher:
    """Fetches the group's log from ``master`` for one slave session. Run it with ``run``."""

    def __init__(
        self,
        *,
        group: str,
        address: str,
        master: str,
        epoch: int,
        log: SegmentedLog,
        history: EpochHistory,
        state: StateStore,
        owner: ReplicaOwner,
        peers: AsyncCaller,
        clock: Clock,
        run_blocking: RunBlocking,
        fetch_bytes: int = DEFAULT_FETCH_BYTES,
        timeout: float = DEFAULT_FETCH_TIMEOUT,
    ) -> None:
        self.group = group
        self.address = address
        self.master = master
        self.epoch = epoch
        self._log = log
        self._history = history
        self._state = state
        self._owner = owner
        self._peers = peers
        self._clock = clock
        self._run_blocking = run_blocking
        self._fetch_bytes = fetch_bytes
        self._timeout = timeout
        self._backoff = Backoff(initial_ms=50, maximum_ms=2_000, jitter="equal")
        self._session: str | None = None
        self._seq = 0
        self._fetches = 0
        self._bytes = 0
        self._failures = 0
        self._cut = 0
        self._master_end = 0
        self._last_answer_ms: int | None = None
        #: Told when a fetch fails: the master may be gone, so the owner asks the metaserver sooner.
        self.on_failed: Callable[[], None] = lambda: None

    def statistics(self) -> FetcherStatistics:
        return FetcherStatistics(
            master=self.master,
            epoch=self.epoch,
            fetches=self._fetches,
            bytes_received=self._bytes,
            failures=self._failures,
            cut_bytes=self._cut,
            master_durable_end=self._master_end,
            last_answer_ms=self._last_answer_ms,
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        backoff = BackoffRun(self._backoff)
        failing_since: int | None = None
        while True:
            try:
                await self.fetch_once()
            except (TransportError, ProtocolError, StorageError) as error:  # a full disk too: retried
                self._failures += 1
                self.on_failed()
                if failing_since is None:
                    failing_since = self._clock.monotonic_ms()
                    level = (
                        logging.ERROR
                        if isinstance(error, PeerError) and error.code == OFFSET_DELETED
                        else logging.WARNING
                    )
                    log.log(
                        level,
                        "slave %s of %s: fetch from master %s failed: %s; retrying",
                        self.address,
                        self.group,
                        self.master,
                        error,
                    )
                await self._clock.sleep_ms(backoff.next_delay_ms())
                continue
            if failing_since is not None:
                log.warning(
                    "slave %s of %s: fetching from master %s again after %.1f s",
                    self.address, self.group, self.master, (self._clock.monotonic_ms() - failing_since) / 1000,
                )  # fmt: skip
                failing_since = None
            backoff.reset()

    async def fetch_once(self) -> FetchAnswer:
        """One FETCH and everything it brings, made durable."""
        request = FetchRequest(
            group=self.group,
            address=self.address,
            epoch=self.epoch,
            offset=self._log.flushed_offset,
            last_epoch=self._history.latest,
            session=self._session,
            seq=self._seq,
            max_bytes=self._fetch_bytes,
        )
        frame = await self._peers.call(self.master, Command.FETCH, request.as_metadata(), timeout=self._timeout)
        answer = FetchAnswer.from_metadata(frame.metadata)
        self._fetches += 1
        self._last_answer_ms = self._clock.monotonic_ms()
        self._master_end = answer.durable_end
        if answer.truncate_to is not None:
            cut = self._log.end_offset - answer.truncate_to
            log.warning(
                "slave %s of %s: master %s (epoch %d) never had this log's last %d byte(s) from offset %d; cutting them",
                self.address, self.group, self.master, answer.epoch, cut, answer.truncate_to,
            )  # fmt: skip
            await self._owner.cut_back(answer.truncate_to)
            self._cut += cut
            self._history.cut(answer.truncate_to)
            await self._run_blocking(partial(self._history.save, self._state))
            return answer
        body = frame.body
        if body:
            if answer.offset != self._log.end_offset:
                raise ProtocolError(
                    f"FETCH answer holds bytes for offset {answer.offset}, the log ends at {self._log.end_offset}",
                    code="bad_metadata",
                    field="offset",
                )
            await self._run_blocking(partial(_append_durably, self._log, body, answer.offset))
            self._bytes += len(body)
        if self._history.adopt(answer.history, self._log.end_offset):
            await self._run_blocking(partial(self._history.save, self._state))
        if answer.journal or answer.reset:
            await self._owner.take_journal(answer.journal, reset=answer.reset)
        self._session, self._seq = answer.session, answer.seq
        self._owner.take_tick(answer.tick, master_now_ms=answer.now_ms, master_durable_end=answer.durable_end)
        self._owner.agreed(self._log.end_offset)
        return answer


def _append_durably(log_: SegmentedLog, data: bytes, at: int) -> None:
    log_.append(data, at=at)
    log_.flush()


__all__ = ["DEFAULT_FETCH_BYTES", "FetcherStatistics", "ReplicaFetcher", "ReplicaOwner"]
