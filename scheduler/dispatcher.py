"""The dispatcher: opens hours, loads seconds, fires due messages, hands them to realtime.

Four kinds of trio task share one ``WheelSet`` (the pure rules) on the event loop;
every disk read or write runs through ``run_blocking`` (a worker thread):

- the **loader** (``dispatchloader``) opens due hours (heads table + dispatch log ->
  ``SecondWheel``), walks the chains of seconds about ``load_ahead_ms`` ahead and reads
  their records into memory (``readahead``: bounded by ``max_loaded`` entries and
  ``max_cached_bytes``), reads the records of arrivals linked into seconds already loaded
  (one thread call for all hours, through readers kept open), and closes finished hours;
- the **firer** (``dispatchfirer``) sleeps until the next non-empty millisecond (or a
  poke), pops what is due (never anything later than now) and appends each record to its
  subject's lane. A lane whose SEND returns fires too (``Firer.fire_now``, before it
  builds its next batch), so while a SEND is on the way the firer sleeps ``fire_slack_ms``
  past the next due moment: what falls due meanwhile goes out with the returning lane's
  next batch, and the firer's own wake-up (which costs about as much as firing) is mostly
  saved; a subject with no SEND on the way is fired at most ``fire_slack_ms`` late for it.
  One firing at a time (``Firer._firing``) keeps the firing order within every lane;
- one **lane** (``dispatchlanes``) per subject with messages on the way sends them in
  order, in batches (``dispatch_batch`` records, ``dispatch_bytes`` bytes) through
  ``deliver`` (SEND on the ``scheduler-delivery`` route: a realtime group for the subject,
  other groups tried per call). A failed batch stays at the head of its lane and is
  retried with a growing backoff with jitter (capped; an interval of the monotonic clock),
  logged once per outage: nothing is dropped and order within a subject holds. A batch is
  never sent before the wall clock reads its messages' ``deliver_at``, even if the clock
  stepped back after they fired. With ``send_interval_ms`` a lane starts its SENDs at
  least that far apart (and stays that long after its last one), firing what fell due in
  between into one batch: fewer SENDs for up to that much more lateness. With
  ``send_ahead_ms`` the loader, firer and lanes run on the wall clock read that much
  early (``AheadClock``): each message is sent that long before its ``deliver_at``, and
  realtime holds it until then (``delaymq.realtime.delivery.pick``), so the SEND's round
  trip, the interval and the firer's delays come before the moment instead of after it;
- the **confirmer** (``dispatchconfirmer``) records what realtime accepted in the hours'
  dispatch logs (one thread call and one fsync per round; while more is on the way, rounds
  start at least ``confirm_interval_ms`` apart, so one round covers the SENDs accepted
  meanwhile) and only then marks it done in the wheel, which moves the tick and frees the
  memory budget.

``Dispatcher`` builds the four, runs them, and drains them for a handover.

Docs: docs/scheduler.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from delaymq.clock import Clock
from delaymq.protocol.backoff import RandomSource
from delaymq.protocol.histogram import LatencyHistogram
from delaymq.scheduler.dispatchconfirmer import Confirmer
from delaymq.scheduler.dispatchcontext import DispatchContext
from delaymq.scheduler.dispatchfirer import Firer, Skip
from delaymq.scheduler.dispatchlanes import Deliver, Lanes
from delaymq.scheduler.dispatchloader import Loader
from delaymq.scheduler.schedulelog import ScheduleStore
from delaymq.scheduler.wheelset import Due, WheelSet
from delaymq.storage.threads import RunBlocking

DEFAULT_DISPATCH_BATCH = 1_000
DEFAULT_DISPATCH_BYTES = 4 << 20
DEFAULT_MAX_CACHED_BYTES = 256 << 20
DEFAULT_MAX_SENDS = 16
DEFAULT_BACKOFF_MS = 100
DEFAULT_MAX_BACKOFF_MS = 5_000

#: While records are on their way, dispatch-log rounds start at least this far apart: a
#: round's thread hand-off and fsync cost more than its entries. The tick (replicated every
#: 50 ms) lags by at most this; once everything fired is accepted the round starts at once.
DEFAULT_CONFIRM_INTERVAL_MS = 10
#: While a SEND is on the way the firer wakes this long after the next due moment (the
#: returning lane fires first, as a rule).
DEFAULT_FIRE_SLACK_MS = 2
#: A lane starts its SENDs at least this far apart (monotonic ms): what falls due in
#: between goes in one batch, so SENDs (and realtime's fsyncs and the consumers' PULLs
#: they cause) follow this rate rather than the SEND round trip. 0: no wait.
DEFAULT_SEND_INTERVAL_MS = 0
#: The firer fires each message this long before its ``deliver_at`` (realtime stores it
#: at once and hands it out from ``deliver_at``), so the SEND's round trip and the firer's
#: own delays are spent before the moment. 0: fire at the moment.
DEFAULT_SEND_AHEAD_MS = 0
#: At most this far ahead (a realtime server refuses a ``deliver_at`` over a minute ahead;
#: a message fired ahead can no longer be cancelled).
MAX_SEND_AHEAD_MS = 10_000


@dataclass(frozen=True, slots=True)
class DispatcherStatistics:
    dispatched: int  # records a realtime server accepted
    batches: int  # SEND requests accepted
    failures: int  # SEND requests that failed (each retried)
    recorded: int  # entries newly written to dispatch logs
    lateness_max_ms: int  # accepted - deliver_at, worst since start (overdue restarts included)
    lateness_mean_ms: float
    lanes: int  # subjects with messages on the way
    waiting: int  # records in lanes, not yet accepted
    cached_records: int  # records read ahead, not yet due
    cached_bytes: int
    delivered_held: int  # entry numbers of the open hours delivered before a restart, not loaded yet
    in_outage: bool  # some subject's delivery is failing right now
    hours_opened: int
    seconds_loaded: int
    fire_rounds: int  # times the firer popped due messages and put them in lanes
    confirm_rounds: int  # dispatch-log rounds (one thread call and one flush each)
    fire_reads: int  # fire rounds that read records from disk (not in memory: due at once, or over budget)
    lateness_fired: dict[str, Any]  # fired - deliver_at per message, ms (``LatencyHistogram.to_wire``)
    damaged: int = 0  # due records that did not check when read: not sent, recorded done


class Dispatcher:
    """Fires the ``WheelSet``'s due messages through ``deliver``. Run it with ``run``."""

    def __init__(
        self,
        *,
        store: ScheduleStore,
        wheels: WheelSet,
        deliver: Deliver,
        clock: Clock,
        run_blocking: RunBlocking,
        dispatch_batch: int = DEFAULT_DISPATCH_BATCH,
        dispatch_bytes: int = DEFAULT_DISPATCH_BYTES,
        max_cached_bytes: int = DEFAULT_MAX_CACHED_BYTES,
        max_sends: int = DEFAULT_MAX_SENDS,
        backoff_ms: int = DEFAULT_BACKOFF_MS,
        max_backoff_ms: int = DEFAULT_MAX_BACKOFF_MS,
        confirm_interval_ms: int = DEFAULT_CONFIRM_INTERVAL_MS,
        fire_slack_ms: int = DEFAULT_FIRE_SLACK_MS,
        send_interval_ms: int = DEFAULT_SEND_INTERVAL_MS,
        send_ahead_ms: int = DEFAULT_SEND_AHEAD_MS,
        random: RandomSource | None = None,
        on_recorded: Callable[[dict[int, list[int]]], None] | None = None,
    ) -> None:
        _check_at_least(
            1, dispatch_batch=dispatch_batch, dispatch_bytes=dispatch_bytes, max_sends=max_sends, backoff_ms=backoff_ms
        )
        _check_at_least(
            0,
            confirm_interval_ms=confirm_interval_ms,
            fire_slack_ms=fire_slack_ms,
            send_interval_ms=send_interval_ms,
            send_ahead_ms=send_ahead_ms,
        )
        if max_backoff_ms < backoff_ms:
            raise ValueError(f"max_backoff_ms ({max_backoff_ms}) must be at least backoff_ms ({backoff_ms})")
        self.store = store
        self.wheels = wheels
        self.send_ahead_ms = send_ahead_ms
        context = DispatchContext.build(
            store=store,
            wheels=wheels,
            wall=clock,
            send_ahead_ms=send_ahead_ms,
            run_blocking=run_blocking,
            max_cached_bytes=max_cached_bytes,
        )
        self.load_alarm = context.load_alarm
        self.fire_alarm = context.fire_alarm
        self._read_ahead = context.read_ahead
        #: Set once nothing is on the way (``_settle``): what ``drain`` waits for.
        self._settled: trio.Event | None = None
        self._confirmer = Confirmer(
            context,
            confirm_interval_ms=confirm_interval_ms,
            on_recorded=on_recorded,
            settle=self._settle,
            more_coming=self._more_coming,
        )
        self._lanes = Lanes(
            context,
            deliver=deliver,
            confirmer=self._confirmer,
            dispatch_batch=dispatch_batch,
            dispatch_bytes=dispatch_bytes,
            max_sends=max_sends,
            backoff_ms=backoff_ms,
            max_backoff_ms=max_backoff_ms,
            send_interval_ms=send_interval_ms,
            send_ahead_ms=send_ahead_ms,
            random=random,
        )
        self._firer = Firer(context, lanes=self._lanes, fire_slack_ms=fire_slack_ms, settle=self._settle)
        self._loader = Loader(context)

    @property
    def skip(self) -> Skip | None:
        """Filters each hour's due ``(deliver_at, entry)`` before they reach a lane (cancels)."""
        return self._firer.skip

    @skip.setter
    def skip(self, skip: Skip | None) -> None:
        self._firer.skip = skip

    @property
    def recorded(self) -> int:
        """Entries newly written to dispatch logs."""
        return self._confirmer.recorded

    @property
    def lateness_fired(self) -> LatencyHistogram:
        """Fired (put in its lane) - deliver_at of each message: the first stage of its lateness."""
        return self._firer.lateness_fired

    # ------------------------------------------------------------------ running

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Load, fire, send and confirm until cancelled."""
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._loader.run)
                self._firer.start(nursery)
                nursery.start_soon(self._confirmer.run)
                task_status.started()
        finally:
            self._read_ahead.close_readers()

    def poke(self) -> None:
        """Something arrived (or changed): both sleepers work out their next moment again."""
        self.load_alarm.poke()
        self.fire_alarm.poke()

    async def hand_out(self, due: Due) -> None:
        """Fire these after all (a cancel held them back and its write failed)."""
        await self._firer.hand_out(due)

    async def drain(self) -> None:
        """Fire nothing more; return once everything handed out is accepted and recorded
        (a graceful handover: the slave taking over then holds every dispatch record)."""
        self._firer.pause()
        while self._on_the_way():
            self._settled = trio.Event()
            self._confirmer.hurry()  # no more is coming: the confirmer's pause ends
            await self._settled.wait()
        self._settled = None

    def _on_the_way(self) -> bool:
        """Records are being handed out, wait in lanes, or are not yet recorded."""
        confirmer = self._confirmer
        return bool(self._firer.handing_out or self._lanes.waiting or confirmer.pending or confirmer.confirming)

    def _settle(self) -> None:
        """Wake ``drain`` if nothing is on the way now (called where that may have become so)."""
        if self._settled is not None and not self._on_the_way():
            self._settled.set()

    def _more_coming(self) -> bool:
        """Records wait in lanes and firing goes on: the confirmer gathers them in one round."""
        return bool(self._lanes.waiting) and not self._firer.paused

    def resume(self) -> None:
        """Fire again after ``drain`` (a handover that did not happen)."""
        self._firer.resume()
        self.load_alarm.poke()

    def statistics(self) -> DispatcherStatistics:
        lanes = self._lanes
        firer = self._firer
        accepted = lanes.dispatched
        return DispatcherStatistics(
            dispatched=accepted,
            batches=lanes.batches,
            failures=lanes.failures,
            recorded=self._confirmer.recorded,
            lateness_max_ms=lanes.lateness_max,
            lateness_mean_ms=lanes.lateness_sum / accepted if accepted else 0.0,
            lanes=len(lanes.by_subject),
            waiting=lanes.waiting,
            cached_records=self._read_ahead.records_held,
            cached_bytes=self._read_ahead.bytes_held,
            delivered_held=self.wheels.delivered_held(),
            in_outage=lanes.outage_since is not None,
            hours_opened=self._loader.hours_opened,
            seconds_loaded=self._loader.seconds_loaded,
            fire_rounds=firer.rounds,
            confirm_rounds=self._confirmer.rounds,
            fire_reads=firer.reads,
            lateness_fired=firer.lateness_fired.to_wire(),
            damaged=firer.damaged,
        )


def _check_at_least(least: int, **values: int) -> None:
    for name, value in values.items():
        if value < least:
            raise ValueError(f"{name} must be at least {least}, got {value}")


__all__ = [
    "DEFAULT_DISPATCH_BATCH",
    "DEFAULT_DISPATCH_BYTES",
    "DEFAULT_SEND_AHEAD_MS",
    "DEFAULT_SEND_INTERVAL_MS",
    "MAX_SEND_AHEAD_MS",
    "Deliver",
    "Dispatcher",
    "DispatcherStatistics",
]
