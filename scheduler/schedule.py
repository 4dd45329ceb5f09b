"""SCHEDULE: check a batch, keep each (subject, id) once, append it to the message log.

Every record is checked (``scan_batch`` with the horizon). A record already due is filed
at the time of receipt (a message is never filed into an hour before the current one:
``delaymq.wheel.tick``) and delivered at once: a past ``deliver_at`` is kept, so the
consumer sees the moment its producer asked for and lateness is measured against it
(each run of such records goes in a LATE record that says when they are filed for,
``late_record``); a ``deliver_at`` of 0 or below ("now") is set to the time of receipt.
A record whose (subject, id) is scheduled and not yet delivered
(in the index or the unfiled tail), or comes twice in the batch, is answered
"duplicate" and left out. The rest is appended as one batch, answered once durable
under the flush policy and, under sync replication, held by ``min_insync`` in-sync
slaves; replay is then woken to file it.

Backpressure: while replay is more than ``max_unfiled_bytes`` behind the log's end a
SCHEDULE waits, and is refused ``unavailable`` (nothing stored: the client retries)
after ``FILING_WAIT_MS``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import groupby
from operator import itemgetter
from typing import Any

import trio

from delaymq.clock import Clock
from delaymq.net.limits import Limits
from delaymq.net.requests import Request
from delaymq.protocol.cancel import MAX_KEY
from delaymq.protocol.errors import RemoteProtocolError
from delaymq.protocol.records import MessageBatch, rewrite_delivery, scan_batch
from delaymq.scheduler.cancels import Found, ScheduledBatch, fresh_records, look_up_fresh
from delaymq.scheduler.counters import SchedulerCounters
from delaymq.scheduler.current import CurrentSession
from delaymq.scheduler.hours import MAX_DELIVER_AT
from delaymq.scheduler.idindex import KEY_FIELDS, KEY_FIELDS_AT, record_key
from delaymq.scheduler.indexrecords import LATE_RECORDS_AT, late_record
from delaymq.scheduler.roles import MasterSession
from delaymq.storage.errors import StorageError, storage_refusal
from delaymq.storage.threads import RunBlocking

#: How long a SCHEDULE waits for filing to catch up before it is refused ``unavailable``.
FILING_WAIT_MS = 5_000
#: A LATE record holds at most this many bytes of records (a record bigger alone gets one of its own).
LATE_RECORD_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class _Kept:
    """The records of a batch that are new: their batch indexes and what the tail needs of each."""

    indexes: Sequence[int]
    keys: list[str]
    hashes: list[bytes | None]
    deliver_ats: list[int]
    subjects: list[str]


class ScheduleHandler:
    """Answers SCHEDULE on a master; counts what it accepted."""

    def __init__(
        self,
        *,
        current: CurrentSession,
        clock: Clock,
        limits: Limits,
        run_blocking: RunBlocking,
        max_unfiled_bytes: int,
        on_appended: Callable[[], None],
    ) -> None:
        self._current = current
        self._clock = clock
        self._limits = limits
        self._run_blocking = run_blocking
        self._max_unfiled_bytes = max_unfiled_bytes
        #: Called after each append (the housekeeper saves counters, deletes filed segments).
        self._on_appended = on_appended
        self.requests = 0  # SCHEDULE requests answered
        self.scheduled = 0  # records appended
        self.rewritten = 0  # of them, already due when received: filed for dispatch at once
        self.duplicates = 0  # records answered "duplicate"
        self.waits = 0  # SCHEDULEs that waited for filing (``_filing_room``)

    def counters(self) -> SchedulerCounters:
        """This process's share of the totals."""
        return SchedulerCounters(schedule_requests=self.requests, scheduled=self.scheduled, rewritten=self.rewritten)

    async def handle(self, request: Request) -> dict[str, Any]:
        current = self._current
        session = current.taking_requests("SCHEDULE")
        body = request.batch_body()
        batch = scan_batch(body, self._limits, now_ms=self._clock.now_ms())  # refuses deliver_at beyond the horizon
        await self._filing_room(session)
        now = self._clock.now_ms()
        _check_last_hour(batch.deliver_ats)
        keys, hashes = index_keys(batch)
        session.source.check_insync("SCHEDULE")
        await session.mastership.confirm()
        fresh, overlap = await self._fresh(session, keys, batch.subjects)
        current.check_master(session, "SCHEDULE")
        duplicates = len(fresh) - sum(fresh)
        self.duplicates += duplicates
        if not duplicates:
            results = ["scheduled"] * len(fresh)
        else:
            results = ["scheduled" if new else "duplicate" for new in fresh]
        if duplicates == len(fresh):  # a "duplicate" is an answer too: its first copy is replicated
            await session.source.confirm_replicated(
                current.member.log.end_offset,
                timeout_ms=current.replication_timeout_ms,
                what=f"SCHEDULE at {current.address or '-'}",
            )
        else:
            await self._append(session, batch, _kept(batch, keys, hashes, fresh, duplicates), now, overlap)
        self.requests += 1
        return {"results": results, "group": current.group}

    async def _append(self, session: MasterSession, batch: MessageBatch, kept: _Kept, now: int, overlap: bool) -> None:
        """Append the kept records (overdue ones filed at ``now``) and put them in the tail."""
        data: bytes = batch.buf
        overdue = min(batch.deliver_ats) < now
        starts: list[int] | None = None  # where each record starts in ``data``, if not end to end
        if len(kept.indexes) < len(batch.starts) or overdue:
            data, starts = self._records(batch, kept.indexes, now)
        done = session.appending.start(kept.keys)
        try:
            # Shielded: once handed to the writer the batch may reach the log, and then the
            # tail must say so (a retry of it is a duplicate).
            with trio.CancelScope(shield=True):
                offset = await self._current.writer.append(data)  # queued at once: a session that ends later waits
        except StorageError as error:  # the disk failed (full?): retried here later, or another group takes it
            raise storage_refusal("SCHEDULE: the message log could not store the batch", error) from error
        finally:
            session.appending.end(done)
        end = offset + len(data)
        # The tail holds the batch once for all its keys: each filed at max(deliver_at, now).
        ats = [at if at > now else now for at in kept.deliver_ats] if overdue else kept.deliver_ats
        appended = ScheduledBatch(
            kept.keys, ats, kept.hashes, kept.indexes, batch.starts, batch.ends, offset, end, kept.subjects,
            sources=None if starts is None else [offset + start for start in starts],
        )  # fmt: skip
        await self._current.logged(session, appended, end, "SCHEDULE", overlap=overlap)
        self.scheduled += len(kept.indexes)
        self._on_appended()

    def _records(self, batch: MessageBatch, indexes: Sequence[int], now: int) -> tuple[bytes, list[int] | None]:
        """The kept records as appended, and where each starts in them when LATE records wrap
        some (None: end to end). Each is filed at ``max(deliver_at, now)``, never into a
        finished hour: a past ``deliver_at`` is kept (in a LATE record filed at ``now``), one of
        0 or below ("deliver now", no moment asked for) is set to ``now``."""
        pieces: list[tuple[bool, bytes]] = []  # (late?, record)
        for i in indexes:
            record = batch.buf[batch.starts[i] : batch.ends[i]]
            at = batch.deliver_ats[i]
            if at < now:
                self.rewritten += 1
                if at <= 0:
                    record = rewrite_delivery(record, deliver_at=now, attempts=batch.attempts[i])
            pieces.append((0 < at < now, record))
        if not any(late for late, _record in pieces):
            return b"".join(record for _late, record in pieces), None
        parts: list[bytes] = []
        starts: list[int] = []
        size = 0
        for late, run in groupby(pieces, key=itemgetter(0)):
            records = [record for _late, record in run]
            for chunk in _late_chunks(records) if late else [records]:
                at = size + LATE_RECORDS_AT if late else size
                for record in chunk:
                    starts.append(at)
                    at += len(record)
                part = late_record(chunk, filed_at=now) if late else b"".join(chunk)
                parts.append(part)
                size += len(part)
        return b"".join(parts), starts

    async def _filing_room(self, session: MasterSession) -> None:
        """Backpressure: a SCHEDULE waits while replay is more than ``max_unfiled_bytes``
        behind the message log's end, so what is accepted and not yet filed (the unfiled
        tail's memory, and replay reading from the log's memory, not its file) stays bounded
        when producers send faster than filing keeps up (many hours at once). Refused as
        ``unavailable`` (retried by the client, nothing stored) after ``FILING_WAIT_MS``."""
        log, store = self._current.member.log, self._current.store
        if log.end_offset - store.checkpoint <= self._max_unfiled_bytes:
            return
        self.waits += 1
        with trio.move_on_after(FILING_WAIT_MS / 1000):
            while log.end_offset - store.checkpoint > self._max_unfiled_bytes:
                await session.step_filed.wait()
            return
        behind = log.end_offset - store.checkpoint
        raise RemoteProtocolError(
            f"SCHEDULE: filing is {behind} bytes behind (limit {self._max_unfiled_bytes}) after waiting "
            f"{FILING_WAIT_MS} ms; nothing of the batch was stored, retry",
            code="unavailable",
            field="max_unfiled_bytes",
            limit=self._max_unfiled_bytes,
        )

    async def _fresh(self, session: MasterSession, keys: list[str], subjects: Sequence[str]) -> tuple[list[bool], bool]:
        """Which records are new: not a (subject, id) already scheduled and not yet delivered
        (in the index or the unfiled tail), nor the same twice in the batch; and whether a key
        was in the tail or came twice (``fresh_records``). A record whose id is being appended
        right now waits for that append: a duplicate only once it is stored."""
        tail, appending = session.tail, session.appending
        store = self._current.store
        found: Found
        while True:
            busy = appending.waiting_for(keys)
            if busy is not None:
                await busy.wait()
                continue
            checkpoint = store.checkpoint  # what the index holds at least, read below
            if store.past_every_indexed(keys):  # new time-ordered ids: none indexed, no thread needed
                found = None
                break
            epoch = tail.begin_lookup()
            try:
                found = await self._run_blocking(partial(look_up_fresh, store, keys, subjects))
            finally:
                tail.end_lookup(epoch)
            if appending.waiting_for(keys) is None:
                break
        return fresh_records(tail, keys, subjects, found, checkpoint)


def _late_chunks(records: list[bytes]) -> list[list[bytes]]:
    """A run of late records cut into the contents of LATE records of ``LATE_RECORD_BYTES`` at most."""
    chunks: list[list[bytes]] = [[]]
    size = 0
    for record in records:
        if chunks[-1] and size + len(record) > LATE_RECORD_BYTES:
            chunks.append([])
            size = 0
        chunks[-1].append(record)
        size += len(record)
    return chunks


def _check_last_hour(deliver_ats: Sequence[int]) -> None:
    """Refuse a ``deliver_at`` past the last hour a schedule log can be named for."""
    latest = max(deliver_ats)
    if latest > MAX_DELIVER_AT:
        index = deliver_ats.index(latest)
        raise RemoteProtocolError(
            f"record {index}: deliver_at {latest} is past {MAX_DELIVER_AT} (9999-12-31 UTC), "
            "the last hour a schedule log can be named for",
            code="limit",
            field="deliver_at",
            limit=MAX_DELIVER_AT,
            index=index,
        )


def _kept(
    batch: MessageBatch, keys: list[str], hashes: list[bytes | None], fresh: list[bool], duplicates: int
) -> _Kept:
    if not duplicates:  # the common case: every record kept, nothing to pick per record
        return _Kept(range(len(keys)), keys, hashes, batch.deliver_ats, batch.subjects)
    kept = [i for i, new in enumerate(fresh) if new]
    return _Kept(
        kept,
        [keys[i] for i in kept],
        [hashes[i] for i in kept],
        [batch.deliver_ats[i] for i in kept],
        [batch.subjects[i] for i in kept],
    )


def index_keys(batch: MessageBatch) -> tuple[list[str], list[bytes | None]]:
    """Each record's index key and key hash; a ``key`` property that is no business key is refused.
    A record with neither attempts nor properties (most) has its id as index key and no hash."""
    keys: list[str] = list(batch.ids)
    hashes: list[bytes | None] = [None] * len(keys)
    buf = batch.buf
    unpack_key_fields = KEY_FIELDS.unpack_from
    for index, start in enumerate(batch.starts):
        attempts, _id_len, props_len = unpack_key_fields(buf, start + KEY_FIELDS_AT)
        if not attempts and not props_len:
            continue
        try:
            k, hashed, _key = record_key(buf, start, strict=True)
        except ValueError as error:
            raise RemoteProtocolError(
                f"record {index}: property key: {error}", code="bad_value", field="key", limit=MAX_KEY, index=index
            ) from None
        keys[index] = k
        hashes[index] = hashed
    return keys, hashes


__all__ = ["FILING_WAIT_MS", "LATE_RECORD_BYTES", "ScheduleHandler", "index_keys"]
