"""WheelSet: every hour the dispatcher knows of, and what to open, load and fire next.

Pure and deterministic (the h11 way): the dispatcher tells it what the disk said
(heads, chains, replay arrivals, confirmations) and asks it what to do at a given
"now". It never reads the clock or touches a file, so its rules are tested without
sockets or threads (tests/scheduler/test_scheduler_dispatch_wheelset.py).

The rules, in one place:

- **Hours.** The ``HourWheel`` holds every hour with undelivered messages. An hour is
  *opened* (its ``SecondWheel`` built from its heads table, less what the dispatch log
  says was delivered) once it is due or within ``hour_preload_ms`` of its start,
  oldest first, at most ``max_open_hours`` at a time: after a long outage the overdue
  hours go out one window at a time, oldest first, instead of all at once in memory.
- **Seconds.** A second is *loaded* (its chain walked, its records read) about
  ``load_ahead_ms`` before it is due, in (hour, second) order, while fewer than
  ``max_loaded`` entries are held in memory (loaded or sent and not confirmed). A
  second that sorts before something already loaded is loaded whatever the budget:
  it blocks firing until it is (``SecondWheel.pop_due`` keeps the firing order).
- **Firing.** ``pop_due(now)`` hands out everything due, oldest hour first; an hour
  still waiting for a due second to be loaded holds back every later hour.
- **Arrivals.** Replay reports the entries it filed (``arrive``). For an open hour
  they are linked into loaded seconds or counted in unloaded ones, unless a disk read
  of that hour is under way (``begin_open``/``begin_load``): that read snapshotted
  the hour's entry count, so arrivals wait in a buffer and are applied, skipping the
  ones the read already saw, when it ends. The entries linked into loaded seconds
  are listed for ``take_linked``: their records were not read with their second. An
  arrival into an hour that is not open
  (a later hour, or one finished and closed already) only adds the hour: opening it
  reads the heads, which include the arrival, and an overdue hour fires at once.
- **Closing.** An open hour whose entries are all confirmed is closed once it has
  ended ``done_grace_ms`` ago (so the current hour stays open for new arrivals).
- **Tick.** ``tick(now)`` is the tick of the earliest hour not done, or of the
  current hour, whichever is earlier (``delaymq.wheel.tick``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from delaymq.wheel import DEFAULT_AHEAD_MS, HOUR_MS, HourWheel, SecondWheel, Tick, WheelError, hour_of

#: Seconds are read ahead this long before they are due (the wheel's own default). Short,
#: because an arrival into a second already read costs more (linked one by one, its record
#: read alone) than one counted and read with its second later: a producer sending flat out
#: into 2-20 s was accepted 12-19 % faster than at 10 s. Ample for a disk read: within the
#: ``max_loaded`` budget (500,000 entries) a second's chain and records read in about 1.6 s
#: at the 310,000 records/s docs/scheduler-storage.md measured; a bigger second, or a disk
#: stalled for longer, leaves records to the firer, read when they fall due (late, not lost).
DEFAULT_LOAD_AHEAD_MS = DEFAULT_AHEAD_MS
DEFAULT_HOUR_PRELOAD_MS = 300_000
DEFAULT_MAX_OPEN_HOURS = 8
DEFAULT_MAX_LOADED = 500_000
DEFAULT_DONE_GRACE_MS = 10_000

#: What ``pop_due`` hands out: per hour, ``(deliver_at_ms, entry_no)`` in firing order.
Due = list[tuple[int, list[tuple[int, int]]]]


@dataclass(frozen=True, slots=True)
class Load:
    """One second to walk: entries ``floor <= n < below`` of its chain."""

    hour: int
    second: int
    below: int
    floor: int
    count: int  # entries the wheel counts for the second


@dataclass(frozen=True, slots=True)
class WheelSetCounts:
    """Where the entries of the open hours are (a snapshot)."""

    hours: int  # hours with undelivered messages
    open_hours: int
    unloaded: int  # in seconds not walked yet
    scheduled: int  # loaded, not yet due
    in_flight: int  # handed out, not confirmed
    buffered: int  # arrivals waiting for a disk read of their hour to end


class WheelSet:
    """The hour wheel and the second wheels of the open hours, with the rules above."""

    def __init__(
        self,
        hours: Iterable[int] = (),
        *,
        load_ahead_ms: int = DEFAULT_LOAD_AHEAD_MS,
        hour_preload_ms: int = DEFAULT_HOUR_PRELOAD_MS,
        max_open_hours: int = DEFAULT_MAX_OPEN_HOURS,
        max_loaded: int = DEFAULT_MAX_LOADED,
        done_grace_ms: int = DEFAULT_DONE_GRACE_MS,
    ) -> None:
        for name, value, low in (
            ("load_ahead_ms", load_ahead_ms, 0),
            ("hour_preload_ms", hour_preload_ms, 0),
            ("max_open_hours", max_open_hours, 1),
            ("max_loaded", max_loaded, 1),
            ("done_grace_ms", done_grace_ms, 0),
        ):
            if not isinstance(value, int) or value < low:
                raise WheelError(f"{name}={value!r}: must be an int >= {low}")
        self.load_ahead_ms = load_ahead_ms
        self.hour_preload_ms = hour_preload_ms
        self.max_open_hours = max_open_hours
        self.max_loaded = max_loaded
        self.done_grace_ms = done_grace_ms
        self._hours = HourWheel(hours)
        self._open: dict[int, SecondWheel] = {}
        self._busy: dict[int, int] = {}  # hour -> disk reads under way (opening counts one)
        self._buffered: dict[int, list[tuple[int, Sequence[int]]]] = {}
        self._frontier = (-1, -1)  # the latest (hour, second) ever loaded
        self._linked: dict[int, list[int]] = {}  # hour -> entries linked by arrivals, not taken yet
        self._short_of_budget = False  # the last seconds_to_load left seconds out for the budget

    # -- hours ---------------------------------------------------------------------

    def hours(self) -> list[int]:
        """The hours with undelivered messages, oldest first."""
        return list(self._hours)

    def open_hours(self) -> list[int]:
        return sorted(self._open)

    def wheel(self, hour: int) -> SecondWheel | None:
        """The open hour's second wheel (for status and tests), or None."""
        return self._open.get(hour)

    def hours_to_open(self, now_ms: int) -> list[int]:
        """Hours due (or within ``hour_preload_ms``) and not open, oldest first, as many
        as the ``max_open_hours`` window has room for."""
        room = self.max_open_hours - len(self._open) - sum(1 for h in self._busy if h not in self._open)
        out: list[int] = []
        if room <= 0:
            return out
        last = hour_of(now_ms + self.hour_preload_ms)
        for hour in self._hours.hours_between(0, last + 1):
            if hour in self._open or hour in self._busy:
                continue
            out.append(hour)
            if len(out) == room:
                break
        return out

    def begin_open(self, hour: int) -> None:
        """The heads of ``hour`` are about to be read: buffer its arrivals until ``opened``."""
        if hour in self._open or hour in self._busy:
            raise WheelError(f"begin_open(hour={hour}): already open or opening")
        self._hours.add(hour)
        self._busy[hour] = 1
        self._buffered[hour] = []

    def opened(self, hour: int, counts: Sequence[int], known: int, delivered: Iterable[int]) -> None:
        """Build ``hour``'s wheel from its heads (``counts``, covering entries below
        ``known``) and the dispatch log's ``delivered`` entries, then apply what arrived."""
        if self._busy.get(hour) != 1 or hour in self._open:
            raise WheelError(f"opened(hour={hour}): begin_open was not called")
        wheel = SecondWheel.from_counts(hour, counts)
        if wheel.pending().known != known:
            raise WheelError(f"opened(hour={hour}): counts add up to {wheel.pending().known}, not {known}")
        wheel.mark_delivered(delivered)
        self._open[hour] = wheel
        self._end_busy(hour)

    def open_failed(self, hour: int) -> None:
        """The heads read failed: forget the attempt (the hour stays in the hour wheel)."""
        if hour not in self._open and self._busy.pop(hour, 0):
            self._buffered.pop(hour, None)

    def hours_to_close(self, now_ms: int) -> list[int]:
        """Open hours with every entry confirmed that ended ``done_grace_ms`` ago."""
        limit = now_ms - self.done_grace_ms
        return [
            hour
            for hour, wheel in self._open.items()
            if (hour + 1) * HOUR_MS <= limit and not self._busy.get(hour) and wheel.is_done()
        ]

    def close(self, hour: int) -> None:
        """Forget a finished hour (``hours_to_close``); a later arrival opens it again."""
        wheel = self._open.get(hour)
        if wheel is None or self._busy.get(hour) or not wheel.is_done():
            raise WheelError(f"close(hour={hour}): not an open, idle, finished hour")
        del self._open[hour]
        self._hours.discard(hour)
        self._linked.pop(hour, None)

    # -- arrivals ------------------------------------------------------------------

    def arrive(self, hour: int, first_entry: int, ms_in_hour: Sequence[int]) -> None:
        """Replay filed entries ``first_entry, first_entry + 1, ...`` into ``hour``."""
        if not ms_in_hour:
            return
        self._hours.add(hour)
        if self._busy.get(hour):
            self._buffered[hour].append((first_entry, ms_in_hour))
            return
        wheel = self._open.get(hour)
        if wheel is not None:
            _apply(wheel, first_entry, ms_in_hour, self._linked)

    def take_linked(self) -> dict[int, list[int]]:
        """The entries arrivals linked into loaded seconds since the last call, per hour,
        in entry order: the walk of their second did not read their records."""
        linked, self._linked = self._linked, {}
        return linked

    # -- loading -------------------------------------------------------------------

    def loaded_entries(self) -> int:
        """Entries held in memory: loaded and not fired, or fired and not confirmed."""
        total = 0
        for wheel in self._open.values():
            counts = wheel.pending()
            total += counts.scheduled + counts.in_flight
        return total

    def seconds_to_load(self, now_ms: int) -> list[Load]:
        """The seconds to walk now, in (hour, second) order, within the memory budget."""
        budget = self.max_loaded - self.loaded_entries()
        out: list[Load] = []
        for hour in sorted(self._open):
            if self._busy.get(hour):
                continue
            wheel = self._open[hour]
            known = wheel.pending().known
            for second in wheel.seconds_to_load(now_ms, self.load_ahead_ms):
                if budget <= 0 and (hour, second) >= self._frontier:
                    self._short_of_budget = True
                    return out
                count = wheel.count(second)
                out.append(Load(hour, second, known, wheel.walk_floor(second), count))
                budget -= count
        self._short_of_budget = False
        return out

    @property
    def short_of_budget(self) -> bool:
        """The last ``seconds_to_load`` left due seconds out for the ``max_loaded`` budget:
        a confirmation (which frees it) is worth a look."""
        return self._short_of_budget

    def begin_load(self, loads: Iterable[Load]) -> None:
        """The chains of ``loads`` are about to be walked: buffer their hours' arrivals."""
        for load in loads:
            if load.hour not in self._open:
                raise WheelError(f"begin_load(hour={load.hour}): hour is not open")
            if not self._busy.get(load.hour):
                self._buffered[load.hour] = []
            self._busy[load.hour] = self._busy.get(load.hour, 0) + 1

    def delivered(self, hour: int) -> AbstractSet[int]:
        """The open hour's dispatch-logged entries not loaded yet (``SecondWheel.delivered``)."""
        wheel = self._open.get(hour)
        return wheel.delivered() if wheel is not None else frozenset()

    def delivered_held(self) -> int:
        """Dispatch-logged entries of the open hours still held to be skipped."""
        return sum(len(wheel.delivered()) for wheel in self._open.values())

    def loaded(self, load: Load, entries: Iterable[tuple[int, int]]) -> None:
        """The walked chain of one ``Load``: ``(ms_in_hour, entry_no)`` pairs."""
        wheel = self._open.get(load.hour)
        if wheel is None or not self._busy.get(load.hour):
            raise WheelError(f"loaded(hour={load.hour}): begin_load was not called")
        try:
            wheel.load_second(load.second, entries)
        finally:
            self._end_busy(load.hour)
        self._frontier = max(self._frontier, (load.hour, load.second))

    def load_failed(self, load: Load) -> None:
        """The walk of ``load`` failed: the second stays unloaded."""
        if load.hour in self._open and self._busy.get(load.hour):
            self._end_busy(load.hour)

    def next_load_ms(self, now_ms: int) -> int | None:
        """When the loader next has work: an hour to open, a second to walk (only
        later than ``now_ms``; one due now waits for budget), an hour to close."""
        best: int | None = None

        def consider(at: int | None) -> None:
            nonlocal best
            if at is not None and (best is None or at < best):
                best = at

        open_or_opening = len(self._open) + sum(1 for h in self._busy if h not in self._open)
        if open_or_opening < self.max_open_hours:
            for hour in self._hours:
                if hour not in self._open and hour not in self._busy:
                    consider(hour * HOUR_MS - self.hour_preload_ms)
                    break
        for hour, wheel in self._open.items():
            at = wheel.next_load_ms(self.load_ahead_ms)
            if at is not None and at > now_ms:
                consider(at)
            if wheel.is_done():
                consider((hour + 1) * HOUR_MS + self.done_grace_ms)
        return best

    # -- firing --------------------------------------------------------------------

    def pop_due(self, now_ms: int) -> Due:
        """Everything due at ``now_ms``, per hour, oldest hour first, in firing order.

        An hour that still has a due second to load holds back the hours after it."""
        out: Due = []
        for hour in sorted(self._open):
            wheel = self._open[hour]
            got = wheel.pop_due(now_ms)
            if got:
                out.append((hour, got))
            due = wheel.next_due_ms()
            if due is not None and due <= now_ms:
                break
        return out

    def next_due_ms(self) -> int | None:
        """When something is next due (or a due second must be loaded first), or None."""
        best = None
        for wheel in self._open.values():
            due = wheel.next_due_ms()
            if due is not None and (best is None or due < best):
                best = due
        return best

    def confirm(self, hour: int, items: Iterable[tuple[int, int]]) -> int:
        """The realtime server accepted these handed-out ``(deliver_at_ms, entry_no)``."""
        wheel = self._open.get(hour)
        if wheel is None:
            raise WheelError(f"confirm(hour={hour}): hour is not open")
        return wheel.mark_done_many(items)

    # -- position ------------------------------------------------------------------

    def tick(self, now_ms: int) -> Tick:
        """The tick of the earliest hour not done, or of the current hour if earlier."""
        current = hour_of(now_ms)
        for hour in self._hours:
            if hour > current:
                break
            wheel = self._open.get(hour)
            if wheel is None:
                return Tick.start_of(hour)
            if not wheel.is_done():
                return wheel.tick()
        wheel = self._open.get(current)
        return wheel.tick() if wheel is not None else Tick.start_of(current)

    def counts(self) -> WheelSetCounts:
        unloaded = scheduled = in_flight = 0
        for wheel in self._open.values():
            c = wheel.pending()
            unloaded += c.unloaded
            scheduled += c.scheduled
            in_flight += c.in_flight
        buffered = sum(len(ms) for parts in self._buffered.values() for _first, ms in parts)
        return WheelSetCounts(len(self._hours), len(self._open), unloaded, scheduled, in_flight, buffered)

    # -- internals -----------------------------------------------------------------

    def _end_busy(self, hour: int) -> None:
        left = self._busy[hour] - 1
        if left:
            self._busy[hour] = left
            return
        del self._busy[hour]
        parts = self._buffered.pop(hour, [])
        wheel = self._open.get(hour)
        if wheel is not None:
            for first_entry, ms_in_hour in parts:
                _apply(wheel, first_entry, ms_in_hour, self._linked)


def _apply(wheel: SecondWheel, first_entry: int, ms_in_hour: Sequence[int], linked: dict[int, list[int]]) -> None:
    """Tell ``wheel`` of entries it does not know yet (numbers below ``known`` are skipped);
    add those linked into loaded seconds to ``linked[hour]``."""
    known = wheel.pending().known
    skip = known - first_entry
    if skip < 0:
        raise WheelError(
            f"hour {wheel.hour}: arrivals start at entry {first_entry}, the wheel knows {known}: an arrival was lost"
        )
    out = wheel.arrive_many(first_entry + skip, ms_in_hour[skip:] if skip else ms_in_hour)
    if out:
        have = linked.get(wheel.hour)
        if have is None:
            linked[wheel.hour] = out
        else:
            have += out


__all__ = [
    "DEFAULT_DONE_GRACE_MS",
    "DEFAULT_HOUR_PRELOAD_MS",
    "DEFAULT_LOAD_AHEAD_MS",
    "DEFAULT_MAX_LOADED",
    "DEFAULT_MAX_OPEN_HOURS",
    "Due",
    "Load",
    "WheelSet",
    "WheelSetCounts",
]
