"""The scheduler (delay server): SCHEDULE and STATUS over the shared transport.

``open_scheduler`` opens the data folder (``messages/`` the write-ahead message log,
``state/`` lmdb, ``schedule/`` the hourly schedule logs; docs/scheduler-storage.md),
files the message log's tail into the schedule logs, then runs until its block ends:

- **SCHEDULE** checks every record (``scan_batch`` with the horizon), sets a past
  ``deliver_at`` to the time of receipt (a message is never filed into an hour before
  the current one: ``delaymq.wheel.tick``), appends the batch to the message log and
  answers once the append is durable under the flush policy; then wakes replay.
- **replay** files the message log into the schedule logs (``replay_step`` in a
  thread, until caught up) and tells the dispatcher of every entry filed.
- the **dispatcher** (``delaymq.scheduler.dispatcher``) fires each message at its
  millisecond and hands it to a realtime server.
- **cleanup** (every ``cleanup_interval_ms``) deletes message-log segments below the
  replay checkpoint and hours fully delivered longer than ``retention_ms`` ago.
- **STATUS** reports the tick, the pending count of the next hours, the counters.

On start every hour not fully dispatched is loaded again, whatever its age, and the
dispatch logs say what to skip; overdue messages go out at once, oldest first.
Shutdown writes nothing the server would not also have written had it been killed
(``crash`` is the test hook for a kill). Docs: docs/scheduler.md.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import trio

from delaymq.client.registration import Registration, start_registration
from delaymq.client.routes import NoRouteError, RouteClient
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import RemoteProtocolError
from delaymq.protocol.limits import DEFAULT_LIMITS, Limits
from delaymq.protocol.records import rewrite_delivery, scan_batch
from delaymq.protocol.routes import ServerKind
from delaymq.protocol.serving import serve_frames
from delaymq.protocol.transport import AsyncCaller, FrameServer, Request, open_peers, split_listen
from delaymq.scheduler.alarm import Alarm
from delaymq.scheduler.dispatcher import DEFAULT_DISPATCH_BATCH, Deliver, Dispatcher
from delaymq.scheduler.hours import DEFAULT_RETENTION_MS, MAX_DELIVER_AT, ScheduleError, hour_name
from delaymq.scheduler.replay import DEFAULT_STEP_BYTES, replay_step, replay_until_caught_up
from delaymq.scheduler.schedulelog import ScheduleStore
from delaymq.scheduler.status import SchedulerStatistics, parse_status_request, status_answer
from delaymq.scheduler.wheelset import DEFAULT_HOUR_PRELOAD_MS, DEFAULT_LOAD_AHEAD_MS, DEFAULT_MAX_LOADED, WheelSet
from delaymq.storage.errors import StorageError, storage_refusal
from delaymq.storage.log import DEFAULT_SEGMENT_SIZE, SegmentedLog, check_max_record
from delaymq.storage.state import StateStore
from delaymq.storage.threads import RunBlocking, open_blocking, run_in_thread
from delaymq.storage.writer import FlushPolicy, LogWriter, open_log_writer
from delaymq.wheel.clock import Clock

log = logging.getLogger(__name__)

DELIVERY_ROUTE = "scheduler-delivery"
DEFAULT_CLEANUP_INTERVAL_MS = 60_000
#: How often replay looks again while the message log holds appended, not yet fsynced
#: records (``flush="async"``: replay files only what is durable).
_UNFLUSHED_POLL_MS = 50


class Scheduler:
    """One scheduler group. Build it with ``open_scheduler``."""

    def __init__(
        self,
        *,
        group: str,
        clock: Clock,
        limits: Limits,
        message_log: SegmentedLog,
        store: ScheduleStore,
        wheels: WheelSet,
        dispatcher: Dispatcher,
        run_blocking: RunBlocking,
        retention_ms: int,
        cleanup_interval_ms: int,
        pending: int,
        replay_bytes: int = DEFAULT_STEP_BYTES,
    ) -> None:
        self.group = group
        self.address = ""
        self.registration: Registration | None = None
        self.store = store
        self.wheels = wheels
        self.dispatcher = dispatcher
        self._clock = clock
        self._limits = limits
        self._log = message_log
        self._run_blocking = run_blocking
        self._retention_ms = retention_ms
        self._cleanup_interval_ms = cleanup_interval_ms
        self._replay_bytes = replay_bytes
        self._initial_pending = pending
        self._writer: LogWriter | None = None
        self._life: trio.CancelScope | None = None
        self._replay_alarm = Alarm(clock)
        self.frame_server = FrameServer({Command.SCHEDULE: self._schedule, Command.STATUS: self._status}, limits=limits)
        self.crashed = False
        self._requests = 0
        self._scheduled = 0
        self._rewritten = 0
        self._filed = 0
        self._deleted_hours = 0
        self._deleted_segments = 0

    # --------------------------------------------------------------- public

    async def serve_stream(self, stream: trio.abc.Stream) -> None:
        """Serve one connection (tests use it with in-memory streams)."""
        await self.frame_server.serve_stream(stream)

    def statistics(self) -> SchedulerStatistics:
        dispatch = self.dispatcher.statistics()
        counts = self.wheels.counts()
        return SchedulerStatistics(
            address=self.address,
            group=self.group,
            schedule_requests=self._requests,
            scheduled=self._scheduled,
            rewritten=self._rewritten,
            message_log_end=self._log.end_offset,
            checkpoint=self.store.checkpoint,
            filed=self._filed,
            pending=self._initial_pending + self._filed - dispatch.recorded,
            hours=counts.hours,
            open_hours=counts.open_hours,
            loaded=counts.scheduled + counts.in_flight,
            buffered=counts.buffered,
            cached_records=dispatch.cached_records,
            delivered_held=dispatch.delivered_held,
            heads_held_max=self.store.statistics().heads_held_max,
            tick=self.wheels.tick(self._clock.now_ms()),
            dispatched=dispatch.dispatched,
            dispatch_batches=dispatch.batches,
            dispatch_failures=dispatch.failures,
            lateness_max_ms=dispatch.lateness_max_ms,
            lateness_mean_ms=dispatch.lateness_mean_ms,
            lanes=dispatch.lanes,
            waiting=dispatch.waiting,
            in_outage=dispatch.in_outage,
            deleted_hours=self._deleted_hours,
            deleted_segments=self._deleted_segments,
        )

    def crash(self) -> None:
        """Test hook: stop now, as a killed process would.

        Every task is cancelled where it waits; the block's own code is cancelled too
        (``open_scheduler`` then returns quietly). Nothing more is written on the way
        out: no replay step, no dispatch-log record, no checkpoint. Files are closed
        (closing flushes nothing a killed process would not have left in the page
        cache), so the data folder can be opened again in the same process.
        """
        self.crashed = True
        if self._life is not None:
            self._life.cancel()

    async def cleanup(self) -> tuple[int, list[int]]:
        """Delete message-log segments below the checkpoint and hours past retention.

        Returns (segments deleted, hours deleted). Hours the wheels still hold are kept.
        """
        now = self._clock.now_ms()
        keep = set(self.wheels.hours())
        segments, hours = await self._run_blocking(partial(self._delete_old, now, keep))
        self._deleted_segments += segments
        self._deleted_hours += len(hours)
        if segments or hours:
            log.info(
                "scheduler %s: deleted %d message-log segment(s) below offset %d and %d hour(s) "
                "delivered more than %.0f h ago: %s",
                self.group,
                segments,
                self.store.checkpoint,
                len(hours),
                self._retention_ms / 3_600_000,
                " ".join(hour_name(hour) for hour in hours) or "-",
            )
        return segments, hours

    # --------------------------------------------------------------- SCHEDULE

    async def _schedule(self, request: Request) -> dict[str, Any]:
        body = request.batch_body()
        now = self._clock.now_ms()
        batch = scan_batch(body, self._limits, now_ms=now)  # refuses deliver_at beyond the horizon
        deliver_ats = batch.deliver_ats
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
        data: bytes = batch.buf
        if min(deliver_ats) < now:
            # "Deliver now": filed at the time of receipt, never into a finished hour.
            starts, ends, attempts = batch.starts, batch.ends, batch.attempts
            parts = []
            for i, at in enumerate(deliver_ats):
                record = data[starts[i] : ends[i]]
                if at < now:
                    record = rewrite_delivery(record, deliver_at=now, attempts=attempts[i])
                    self._rewritten += 1
                parts.append(record)
            data = b"".join(parts)
        assert self._writer is not None
        try:
            await self._writer.append(data)
        except StorageError as error:  # the disk failed (full?): retried here later, or another group takes it
            raise storage_refusal("SCHEDULE: the message log could not store the batch", error) from error
        self._requests += 1
        self._scheduled += len(deliver_ats)
        self._replay_alarm.poke()
        return {"results": ["scheduled"] * len(deliver_ats)}

    # --------------------------------------------------------------- STATUS

    async def _status(self, request: Request) -> dict[str, Any]:
        wanted = parse_status_request(request.metadata)
        hours = self.wheels.hours()[:wanted]
        store = self.store
        pending = await self._run_blocking(lambda: [store.pending(hour) for hour in hours])
        now = self._clock.now_ms()
        return status_answer(
            self.statistics(), now_ms=now, hours=hours, pending=pending, open_hours=self.wheels.open_hours()
        )

    # --------------------------------------------------------------- background

    async def _replay_loop(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """File what SCHEDULE appended; tell the wheels of every entry filed."""
        task_status.started()
        message_log, store, wheels = self._log, self.store, self.wheels
        step_once = partial(replay_step, message_log, store, max_bytes=self._replay_bytes)
        poll = False
        while True:
            if poll:
                await self._replay_alarm.wait_ms(_UNFLUSHED_POLL_MS)
            else:
                await self._replay_alarm.wait(None)
            while True:
                step = await self._run_blocking(step_once)
                if step.idle:
                    break
                self._filed += step.filed
                for hour, arrivals in step.arrivals.items():
                    wheels.arrive(hour, arrivals.first_entry, arrivals.ms_in_hour)
                self.dispatcher.poke()
            poll = message_log.flushed_offset < message_log.end_offset  # unflushed: look again soon

    async def _cleanup_loop(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await self._clock.sleep_ms(self._cleanup_interval_ms)
            await self.cleanup()

    def _delete_old(self, now_ms: int, keep: set[int]) -> tuple[int, list[int]]:
        segments = self._log.delete_before(self.store.checkpoint)
        deleted = []
        for hour in self.store.hours_to_delete(now_ms, retention_ms=self._retention_ms):
            if hour in keep:
                continue
            try:
                self.store.delete_hour(hour)
            except ScheduleError as error:  # being filed into right now: next time
                log.info("scheduler %s: hour %s not deleted now: %s", self.group, hour_name(hour), error)
                continue
            deleted.append(hour)
        return segments, deleted


# ------------------------------------------------------------------- opening


@asynccontextmanager
async def open_scheduler(
    *,
    data_dir: str | Path,
    clock: Clock,
    listen: str | None = "127.0.0.1:0",
    group: str = "scheduler-1",
    meta_address: str | Sequence[str] | None = None,
    advertise_address: str | None = None,
    flush: FlushPolicy = "sync",
    limits: Limits = DEFAULT_LIMITS,
    load_ahead_ms: int = DEFAULT_LOAD_AHEAD_MS,
    hour_preload_ms: int = DEFAULT_HOUR_PRELOAD_MS,
    retention_ms: int = DEFAULT_RETENTION_MS,
    cleanup_interval_ms: int = DEFAULT_CLEANUP_INTERVAL_MS,
    dispatch_batch: int = DEFAULT_DISPATCH_BATCH,
    max_loaded: int = DEFAULT_MAX_LOADED,
    replay_bytes: int = DEFAULT_STEP_BYTES,
    send_timeout: float = 10.0,
    segment_size: int = DEFAULT_SEGMENT_SIZE,
    run_blocking: RunBlocking = run_in_thread,
    peers: AsyncCaller | None = None,
) -> AsyncIterator[Scheduler]:
    """Open the data folder, catch up, schedule and dispatch until the block ends.

    ``listen=None`` opens no listener (connections go to ``serve_stream``; give
    ``advertise_address`` to register). ``meta_address`` (one or several) is where the
    scheduler registers (kind ``scheduler``) and asks for realtime groups to deliver
    to; ``peers`` replaces the TCP connections to them (in-memory ones in tests).
    ``limits.horizon_ms`` is how far ahead a message may be scheduled. ``run_blocking``
    runs the disk work (default: a worker thread; ``run_inline`` for autojump tests).
    ``replay_bytes`` is how much of the message log one replay step files at most (the
    step's memory; one commit and fsync round per step).
    """
    check_max_record(limits.max_record)
    if retention_ms < 0:
        raise ValueError(f"retention_ms must be >= 0, got {retention_ms}")
    if cleanup_interval_ms <= 0:
        raise ValueError(f"cleanup_interval_ms must be positive, got {cleanup_interval_ms}")
    if send_timeout <= 0:
        raise ValueError(f"send_timeout must be positive, got {send_timeout}")
    if replay_bytes < 1:
        raise ValueError(f"replay_bytes must be at least 1, got {replay_bytes}")
    bind = split_listen(listen) if listen is not None else None
    if listen is None and meta_address is not None and advertise_address is None:
        raise ValueError("listen=None with a meta_address needs an advertise_address to register")
    # Check the wheel settings before touching the data folder.
    WheelSet(load_ahead_ms=load_ahead_ms, hour_preload_ms=hour_preload_ms, max_loaded=max_loaded)
    root = Path(data_dir)
    async with open_blocking(
        partial(_open_storage, root, segment_size), lambda opened: _close_storage(*opened), run_blocking=run_blocking
    ) as (message_log, _state, store):
        hours, pending = await run_blocking(partial(_catch_up, message_log, store))
        wheels = WheelSet(hours, load_ahead_ms=load_ahead_ms, hour_preload_ms=hour_preload_ms, max_loaded=max_loaded)
        async with AsyncExitStack() as stack:
            if peers is None:
                peers = await stack.enter_async_context(open_peers(limits=limits, request_timeout=send_timeout))
            dispatcher = Dispatcher(
                store=store,
                wheels=wheels,
                deliver=_delivery(peers, meta_address, clock, send_timeout),
                clock=clock,
                run_blocking=run_blocking,
                dispatch_batch=dispatch_batch,
            )
            scheduler = Scheduler(
                group=group,
                clock=clock,
                limits=limits,
                message_log=message_log,
                store=store,
                wheels=wheels,
                dispatcher=dispatcher,
                run_blocking=run_blocking,
                retention_ms=retention_ms,
                cleanup_interval_ms=cleanup_interval_ms,
                pending=pending,
                replay_bytes=replay_bytes,
            )
            if hours:
                log.info(
                    "scheduler %s: %d message(s) to deliver in %d hour(s), from %s", group, pending, len(hours),
                    hour_name(hours[0]),
                )  # fmt: skip

            async def register(nursery: trio.Nursery, address: str) -> None:
                assert meta_address is not None
                scheduler.registration = await start_registration(
                    nursery,
                    peers,
                    group=group,
                    kind=ServerKind.SCHEDULER,
                    address=address,
                    meta_address=meta_address,
                    clock=clock,
                )

            # The crash scope holds the writer too: nothing more is written on the way out.
            with trio.CancelScope() as life:
                scheduler._life = life
                async with open_log_writer(message_log, flush=flush, run_blocking=run_blocking) as writer:
                    scheduler._writer = writer
                    async with serve_frames(
                        scheduler.frame_server,
                        bind=bind,
                        advertise_address=advertise_address,
                        tasks=[scheduler.dispatcher.run, scheduler._replay_loop, scheduler._cleanup_loop],
                        register=register if meta_address is not None else None,
                    ) as address:
                        scheduler.address = address
                        log.info("scheduler %s serving on %s (data %s)", group, scheduler.address or "-", root)
                        yield scheduler


def _delivery(
    peers: AsyncCaller, meta_address: str | Sequence[str] | None, clock: Clock, send_timeout: float
) -> Deliver:
    """SEND a subject's batch to a realtime group the metaserver routes it to."""
    routes = None
    if meta_address is not None:
        addresses = [meta_address] if isinstance(meta_address, str) else list(meta_address)
        routes = RouteClient(peers, addresses, clock=clock)

    async def deliver(subject: str, body: bytes) -> list[str]:
        if routes is None:
            raise NoRouteError("no metaserver address (meta_address) was given: no realtime group is known")
        frame = await routes.call(DELIVERY_ROUTE, Command.SEND, {}, body, subject=subject, timeout=send_timeout)
        results = frame.metadata.get("results")
        if not isinstance(results, list):
            raise RemoteProtocolError("SEND answer holds no 'results' list", code="bad_metadata", field="results")
        return results

    return deliver


def _open_storage(root: Path, segment_size: int) -> tuple[SegmentedLog, StateStore, ScheduleStore]:
    root.mkdir(parents=True, exist_ok=True)
    opened: list[Any] = []
    try:
        opened.append(SegmentedLog.open(root / "messages", segment_size=segment_size))
        opened.append(StateStore.open(root / "state", extra_format={"scheduler_state": 1}))
        opened.append(ScheduleStore.open(root / "schedule", opened[1]))
    except BaseException:
        for thing in reversed(opened):
            thing.close()
        raise
    return opened[0], opened[1], opened[2]


def _catch_up(message_log: SegmentedLog, store: ScheduleStore) -> tuple[list[int], int]:
    """File the message log's tail; the hours not fully dispatched and their pending count."""
    step = replay_until_caught_up(message_log, store)
    if step.filed:
        log.info("replayed %d record(s) of the message log into the schedule logs", step.filed)
    hours = store.undispatched_hours()
    return hours, sum(store.pending(hour) for hour in hours)


def _close_storage(message_log: SegmentedLog, state: StateStore, store: ScheduleStore) -> None:
    try:
        store.close()
    finally:
        try:
            message_log.close()
        finally:
            state.close()


__all__ = ["DELIVERY_ROUTE", "Scheduler", "SchedulerStatistics", "open_scheduler"]
