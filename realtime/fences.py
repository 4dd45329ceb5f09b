"""The fence table: the highest epoch seen per scheduler group, durable, checked on every fenced SEND.

A scheduler master puts its group and epoch on each SEND
(``delaymq.protocol.fencing``). ``Fences.admit`` lets a SEND through when its
epoch is at least the highest seen for its group and refuses a lower one with
``fenced``; a deposed master that has not heard the news is so stopped here,
whatever the metaserver knows. The rules:

- An epoch equal to the one remembered durably costs one dict lookup: the hot
  path of every dispatch batch.
- A higher epoch is written to lmdb (one committed write transaction, off the
  event loop) before ``admit`` returns, so the SEND that raised it is answered
  only once it survives a crash, and a restarted server still refuses the lower one.
- Lower than the highest *seen* (durable, or being written for a SEND still
  in flight) is refused at once: once a higher epoch of a group exists its
  older master is stale, even before the write is done. A SEND whose epoch was
  overtaken while it waited for its own write is refused too.
- Raises are written one transaction at a time; each writes every group's
  highest seen epoch, so SENDs that raise at once share a commit.
- An epoch is a time (the metaserver makes each one at least its clock's epoch ms):
  one more than ``MAX_EPOCH_AHEAD_MS`` ahead of this server's clock is refused
  (``limit``, field ``fence.epoch``) and nothing is stored. Else one such SEND would
  fence its scheduler group out for good.
- ``clear`` (CLEAR_FENCE, an admin's) forgets a group's epoch: lmdb first, then the
  slaves, through a progress record in the log, under the same lock as raises so the
  slaves apply clears and raises in the order the master made them.

lmdb layout (a named db of the state store)::

    fences   scheduler group (UTF-8) -> u64 BE: the highest epoch this server has seen
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Awaitable, Callable
from functools import partial

import trio

from delaymq.clock import Clock
from delaymq.protocol.errors import RemoteProtocolError
from delaymq.protocol.fencing import FENCE_FIELD, Fence, fenced_error
from delaymq.storage.errors import StorageError, storage_refusal
from delaymq.storage.state import StateStore
from delaymq.storage.threads import RunBlocking

log = logging.getLogger(__name__)

FENCES_DB = "fences"
_U64 = struct.Struct(">Q")
#: How far ahead of this server's clock a fence's epoch may be: clocks of one deployment
#: differ by far less (an epoch is the metaserver's clock when it promoted a master).
MAX_EPOCH_AHEAD_MS = 86_400_000


def load_fences(store: StateStore) -> dict[str, int]:
    """The fence table as committed (blocking; start-up)."""
    return {key.decode(): _U64.unpack(value)[0] for key, value in store.items(FENCES_DB)}


def write_fences(store: StateStore, epochs: dict[str, int]) -> None:
    """Commit raised epochs in one write transaction (blocking: a worker thread)."""
    with store.write() as batch:
        for group, epoch in epochs.items():
            batch.put(FENCES_DB, group.encode(), _U64.pack(epoch))


def delete_fence(store: StateStore, group: str) -> None:
    """Forget a group's epoch in one write transaction (blocking: a worker thread)."""
    with store.write() as batch:
        batch.delete(FENCES_DB, group.encode())


class Fences:
    """The highest epoch per scheduler group: what lmdb holds, and what SENDs in flight ask for."""

    def __init__(self, *, store: StateStore, run_blocking: RunBlocking, durable: dict[str, int], clock: Clock) -> None:
        self._store = store
        self._clock = clock
        self._run_blocking = run_blocking
        #: Committed to lmdb: a SEND with this epoch passes at once.
        self.durable = dict(durable)
        #: The highest epoch asked for per group, committed or not (at least ``durable``).
        self._seen = dict(durable)
        self._writing = trio.Lock()
        self.refused = 0  # SENDs refused for a lower epoch
        self.raised = 0  # epochs committed higher than before
        #: Under replication: ships the raised epochs to the slaves (before the SEND's batch).
        self.on_raise: Callable[[dict[str, int]], Awaitable[None]] | None = None
        #: Under replication: ships a cleared group to the slaves (after lmdb forgot it here).
        self.on_clear: Callable[[str], Awaitable[None]] | None = None

    def table(self) -> dict[str, int]:
        """The durable table, group -> epoch (for STATUS)."""
        return dict(sorted(self.durable.items()))

    async def admit(self, fence: Fence) -> None:
        """Return when ``fence`` may store its batch: its epoch is the highest of its group, durably.

        Raises ``RemoteProtocolError`` (``fenced``) for a lower epoch, and a
        retryable ``unavailable`` refusal when the raise could not be committed.
        """
        group, epoch = fence.group, fence.epoch
        if self.durable.get(group) == epoch == self._seen.get(group):
            return  # the hot path: no raise of this group in flight
        self._check_ahead(fence)
        self._check(fence)
        if epoch > self._seen.get(group, -1):
            self._seen[group] = epoch
        if self.durable.get(group, -1) < epoch:
            async with self._writing:
                if epoch > self._seen.get(group, -1):  # a clear forgot it meanwhile
                    self._seen[group] = epoch
                if self.durable.get(group, -1) < epoch:  # else a write for another SEND covered it
                    await self._commit_raises()
        self._check(fence)  # overtaken while waiting for the write

    async def clear(self, group: str) -> int | None:
        """Forget ``group``'s epoch durably (here, then on the slaves); returns the epoch it had.

        The next fenced SEND of the group sets its epoch again, whatever it is."""
        async with self._writing:
            before = self.durable.get(group)
            try:
                await self._run_blocking(partial(delete_fence, self._store, group))
            except StorageError as error:
                raise storage_refusal("CLEAR_FENCE: the fence table could not forget the epoch", error) from error
            self.durable.pop(group, None)
            self._seen.pop(group, None)
            if self.on_clear is not None:
                await self.on_clear(group)
        return before

    def _check_ahead(self, fence: Fence) -> None:
        """Refuse an epoch further ahead of this server's clock than any epoch can be."""
        now = self._clock.now_ms()
        if fence.epoch - now > MAX_EPOCH_AHEAD_MS:
            raise RemoteProtocolError(
                f"SEND: {FENCE_FIELD}.epoch {fence.epoch} of scheduler group {fence.group!r} is "
                f"{fence.epoch - now} ms ahead of this server's clock ({now}); an epoch is a time in epoch ms "
                f"and may be at most {MAX_EPOCH_AHEAD_MS} ms (1 day) ahead",
                code="limit",
                field=f"{FENCE_FIELD}.epoch",
                limit=MAX_EPOCH_AHEAD_MS,
            )

    async def _commit_raises(self) -> None:
        """Commit every group's highest seen epoch above its durable one, in one transaction."""
        raised = {group: seen for group, seen in self._seen.items() if seen > self.durable.get(group, -1)}
        try:
            await self._run_blocking(partial(write_fences, self._store, raised))
        except StorageError as error:
            raise storage_refusal("SEND: the fence table could not record the epoch", error) from error
        if self.on_raise is not None:
            await self.on_raise(raised)
        for group, epoch in raised.items():
            before = self.durable.get(group)
            self.durable[group] = epoch
            self.raised += 1
            log.info(
                "realtime: scheduler group %s is at epoch %d now (was %s); lower epochs are refused",
                group,
                epoch,
                "unknown" if before is None else before,
            )

    def _check(self, fence: Fence) -> None:
        """Refuse a lower epoch than the highest seen (the transport logs refusals, rate-limited)."""
        highest = self._seen.get(fence.group, -1)
        if fence.epoch < highest:
            self.refused += 1
            raise fenced_error(fence, highest)


__all__ = ["FENCES_DB", "MAX_EPOCH_AHEAD_MS", "Fences", "delete_fence", "load_fences", "write_fences"]
