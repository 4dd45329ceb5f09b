"""SEND: store each record of a batch once (dedup by id), append the batch to the message log, index it.

Per request the work is one pass over the batch's headers (``scan_batch``).
Records whose id the server stored within the dedup window are answered
"duplicate" and left out; the rest go to the log writer, which batches appends
and answers under the flush policy, and then to the indexer, which files each
record into its subject's consume log and wakes the pulls parked on it. Dead
letters and retries due at once (NACK) are stored the same way, by ``append``.

So a SEND is either stored durably and will be delivered (answered ``stored``;
a failed index step is retried in the background, see ``index``), or refused
as ``unavailable`` (the disk is full: the client retries) and its ids are not
remembered, so the retry stores it. A record whose id is being appended right
now waits for that append: it is a duplicate only once the first is stored.

A scheduled record (``deliver_at`` after ``created_at``) may come ahead of its
``deliver_at`` (a scheduler run with ``--send-ahead``): it is stored at once and handed
out from then (``delivery.pick``). Realtime holds one for at most ``MAX_AHEAD_MS``; one
due later is refused naming ``deliver_at`` (the client sends such messages to a
scheduler). An immediate record's ``deliver_at`` is its producer's clock: never held.

A scheduler's SEND carries a fence (its group and epoch, the only metadata a
SEND takes): ``fences.Fences`` admits it before anything of the batch is
looked at by the dedup window or stored, and refuses an older epoch (``fenced``).
A producer's batch that would make more subjects than the server's cap is
refused whole (``caps.SubjectCap``); a scheduler's passes the cap once its fence is
admitted (counted and logged): it carries messages the scheduler accepted earlier.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import trio

from delaymq.clock import Clock
from delaymq.net.limits import Limits
from delaymq.net.requests import Request
from delaymq.protocol.errors import RemoteProtocolError
from delaymq.protocol.fencing import FENCE_FIELD, Fence
from delaymq.protocol.histogram import LatencyHistogram
from delaymq.protocol.records import MessageBatch, scan_batch
from delaymq.realtime import dedup as dedup_store
from delaymq.realtime.caps import SubjectCap
from delaymq.realtime.dedup import DedupWindow, dedup_keys
from delaymq.realtime.fences import Fences
from delaymq.realtime.index import MAX_AHEAD_MS, Indexer, batch_items
from delaymq.storage.errors import StorageError, storage_refusal
from delaymq.storage.inflight import KeysInFlight
from delaymq.storage.state import StateStore
from delaymq.storage.threads import RunBlocking
from delaymq.storage.writer import LogWriter

_SEND_FIELDS = (FENCE_FIELD,)


class SendHandler:
    """Answers SEND, and stores checked batches for the rest of the server (``append``)."""

    def __init__(
        self,
        *,
        clock: Clock,
        limits: Limits,
        store: StateStore,
        indexer: Indexer,
        dedup: DedupWindow,
        fences: Fences,
        run_blocking: RunBlocking,
        subjects: SubjectCap | None = None,
    ) -> None:
        self._clock = clock
        #: The cap on subjects a SEND may create (None: no cap).
        self.subjects = subjects
        self._run_blocking = run_blocking
        self._limits = limits
        self._store = store
        self._indexer = indexer
        self._dedup = dedup
        self.fences = fences
        #: Set while the server runs: the message log's writer.
        self.writer: LogWriter | None = None
        self.sends = 0  # SEND requests answered
        self.stored = 0
        self.duplicates = 0  # records answered "duplicate"
        #: Accepted (stored, answered) - due of each new record of a SEND, in ms; due is
        #: ``deliver_at``, or ``created_at`` for an immediate message. A scheduler's SENDs make
        #: it the "accepted by realtime" stage of the delay path's lateness.
        self.lateness = LatencyHistogram()
        self._appending = KeysInFlight()  # the ids of appends not finished yet
        #: Under replication: waits until the in-sync slaves hold the log below an offset
        #: (None: all of it so far).
        self.replicated: Callable[[int | None], Awaitable[None]] | None = None

    async def handle(self, request: Request) -> dict[str, Any]:
        fence = Fence.from_metadata(request.metadata)
        batch = scan_batch(request.batch_body(fields=_SEND_FIELDS), self._limits)
        _check_ahead(batch, self._clock.now_ms())
        if fence is not None:
            await self.fences.admit(fence)
        cap = self.subjects
        fenced_by = fence.group if fence is not None else None
        admitted = cap.admit(batch.subjects, fenced_by=fenced_by) if cap is not None else []
        try:
            fresh = await self.append(batch)
        finally:
            if cap is not None:
                cap.settle(admitted)
        self.sends += 1
        now = self._clock.now_ms()
        self.lateness.record_many(
            [now - (due or created) for due, created, new in zip(batch.deliver_ats, batch.created_ats, fresh) if new]
        )
        return {"results": ["stored" if new else "duplicate" for new in fresh]}

    async def append(self, batch: MessageBatch) -> list[bool]:
        """Append a checked batch's new records (dedup) and index them; which records were new."""
        ids = dedup_keys(batch)
        dedup = self._dedup
        appending = self._appending
        while True:
            now = self._clock.now_ms()
            unsure = dedup.to_look_up(ids, now)
            stored: set[str] = set()
            if unsure:
                stored = await self._run_blocking(
                    partial(dedup_store.lookup_stored, self._store, unsure, now - dedup.window_ms)
                )
                now = self._clock.now_ms()
            if now < dedup.bare_ids_until:  # rows of an older version may be in the window
                stored |= await self._stored_bare(ids, now)
            busy = appending.waiting_for(ids)
            if busy is None:
                break
            await busy.wait()  # stored or refused: look again
        fresh = dedup.admit(ids, now, stored)
        kept = [index for index, new in enumerate(fresh) if new]
        self.duplicates += len(ids) - len(kept)
        if not kept:
            if self.replicated is not None:
                await self.replicated(None)  # a "duplicate" is an answer too: its first copy is replicated
            return fresh
        if len(kept) == len(ids):
            data = batch.buf
            kept_ids = ids
        else:
            starts, ends = batch.starts, batch.ends
            data = b"".join([batch.buf[starts[i] : ends[i]] for i in kept])
            kept_ids = [ids[i] for i in kept]
        assert self.writer is not None
        done = appending.start(kept_ids)
        try:
            # Shielded: once handed to the writer the batch may reach the log, and
            # then it must be indexed (the index moves in offset order only).
            with trio.CancelScope(shield=True):
                base = await self.writer.append(data)
        except BaseException as error:
            dedup.forget(kept_ids)  # not stored: a retry must store it
            if isinstance(error, StorageError):
                raise storage_refusal("the message log could not store the batch", error) from error
            raise
        finally:
            appending.end(done)
        items = batch_items(batch, base, kept)
        self._indexer.submit(base, base + len(data), items, kept_ids, self._clock.now_ms())
        self.stored += len(kept)
        if self.replicated is not None:
            await self.replicated(base + len(data))  # sync: answered once the in-sync slaves hold it
        return fresh

    async def _stored_bare(self, ids: list[str], now: int) -> set[str]:
        """Keys of ``ids`` stored within the window by a version that keyed first deliveries by the
        bare id (memory first, then lmdb)."""
        dedup = self._dedup
        stored, unsure = dedup.stored_bare(ids, now)
        if unsure:
            found = await self._run_blocking(
                partial(dedup_store.lookup_stored, self._store, list(unsure), now - dedup.window_ms)
            )
            for message_id in found:
                stored.update(unsure[message_id])
        return stored


def _check_ahead(batch: MessageBatch, now_ms: int) -> None:
    """Refuse a batch holding a scheduled record due more than ``MAX_AHEAD_MS`` from now."""
    latest = now_ms + MAX_AHEAD_MS
    if not batch.deliver_ats or max(batch.deliver_ats) <= latest:
        return
    for index, (due, created) in enumerate(zip(batch.deliver_ats, batch.created_ats)):
        if due > latest and due > created:
            raise RemoteProtocolError(
                f"record {index}: deliver_at {due} is {due - now_ms} ms ahead; a realtime server holds a "
                f"scheduled message for at most {MAX_AHEAD_MS} ms (send it to a scheduler)",
                code="limit",
                field="deliver_at",
                limit=MAX_AHEAD_MS,
                index=index,
            )


__all__ = ["MAX_AHEAD_MS", "SendHandler"]
