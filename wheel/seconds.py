"""Second wheel: one hour's 3,600 one-second slots (docs/architecture.md, "The delay path").

How the scheduler feeds it (all disk work stays outside; this is pure and deterministic,
and every method that needs "now" takes it as an argument):

1. ``SecondWheel.from_counts(hour, counts)`` from the hour's second-heads table: the
   wheel knows how many entries each second holds, not yet which.
2. About ``ahead_ms`` (3 s) ahead of a second (``seconds_to_load`` / ``next_load_ms``) the scheduler
   walks that second's chain in the delay index and hands the ``(ms_in_hour, entry_no)``
   pairs to ``load_second``, in any order. Until then an arrival for that second only
   bumps its count (``note_arrival``); once loaded, an arrival is ``link``-ed in place.
3. ``next_due_ms`` says when to wake (never a busy tick loop); ``pop_due(now_ms)``
   hands out everything due, in firing order (ms within the hour, then entry number),
   never anything whose millisecond is after ``now_ms``.
4. After the realtime server accepted a message the scheduler calls ``mark_done``;
   ``tick()`` is the fully confirmed prefix in firing order (see ``delaymq.wheel.tick``).
5. On restart or failover, ``skip_to(tick)`` and ``mark_delivered(dispatch-log entries)``
   before loading make the wheel skip what was already delivered.

Layout, chosen so per-message work stays O(1) and in C where possible. A loaded second
keeps a sorted list of the distinct milliseconds it holds (``times``, at most 1,000) and,
per millisecond, the entry numbers in order (``groups``). Entry numbers grow in filing
order, so linking an arrival is normally a list append; only a new millisecond costs an
insert into a list of at most 1,000. ``pop_due`` hands out whole millisecond groups with
``zip``/``repeat``. A second's memory is released once all its entries are confirmed.

A message linked behind the firing position (its millisecond is already handed out:
its ``deliver_at`` is in the past) goes to a small heap and fires at the next
``pop_due``: late, never lost. ``pop_due`` also holds back loaded seconds behind a due
second whose chain is not loaded yet (``next_due_ms`` then returns that second's start,
meaning "load it now"), so firing order holds across seconds.

Invariant the scheduler keeps: the wheel is told of every index entry of the hour
(heads table counts, then ``note_arrival``/``link``), so the entries it knows are
exactly numbers ``0 .. known-1``; ``tick().limit`` relies on it.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from collections import Counter
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from itertools import repeat
from operator import floordiv

from sortedcontainers import SortedSet

from delaymq.wheel.hours import HOUR_MS, SECOND_MS, SECONDS_PER_HOUR, WheelError, _check_hour
from delaymq.wheel.tick import NO_LIMIT, Tick

#: How long before a second is due it is loaded, unless the caller says (the scheduler's
#: ``WheelSet.load_ahead_ms``; why 3 s: ``delaymq.scheduler.wheelset``).
DEFAULT_AHEAD_MS = 3_000
_ENTRY_MASK = 0xFFFF_FFFF  # key = ms_in_hour << 32 | entry_no: one int sorts like (ms, entry)


@dataclass(frozen=True, slots=True)
class WheelCounts:
    """Snapshot of where one hour's entries are."""

    unloaded: int  # in seconds whose chain is not walked yet
    scheduled: int  # loaded or linked, not yet handed out by pop_due
    in_flight: int  # handed out, not yet confirmed with mark_done
    known: int  # index entries of the hour the wheel was told about


class _Slot:
    """A loaded second: its entries by millisecond, and how far firing got."""

    __slots__ = ("times", "groups", "cursor", "done_keys", "scan_group", "scan_index", "scan_count")

    def __init__(self, times: list[int], groups: dict[int, list[int]], done_keys: list[int]) -> None:
        self.times = times  # sorted distinct ms_in_hour
        self.groups = groups  # ms_in_hour -> sorted entry numbers (not skipped ones)
        self.cursor = 0  # times[:cursor] are handed out
        self.done_keys = done_keys  # sorted keys skipped at load (already delivered)
        # Tick scan position: groups before (scan_group, scan_index) are all confirmed,
        # scan_count of them. Moves forward only, except when a late link lands behind.
        self.scan_group = 0
        self.scan_index = 0
        self.scan_count = 0


class SecondWheel:
    """One hour's messages on 3,600 one-second slots, fired at their own millisecond."""

    def __init__(self, hour: int, counts: Sequence[int] | None = None) -> None:
        self._hour = _check_hour(hour)
        self._start = hour * HOUR_MS
        self._first_second = hour * SECONDS_PER_HOUR
        if counts is None:
            counts = [0] * SECONDS_PER_HOUR
        if len(counts) != SECONDS_PER_HOUR:
            raise WheelError(f"counts: {len(counts)} given, must be exactly {SECONDS_PER_HOUR}")
        self._counts = [int(c) for c in counts]
        if min(self._counts) < 0:
            raise WheelError(f"counts: second {self._counts.index(min(self._counts))} is negative")
        self._known = sum(self._counts)
        if self._known > NO_LIMIT:
            raise WheelError(f"counts: {self._known} entries, an hour holds at most {NO_LIMIT}")
        self._open = list(self._counts)  # per second: entries not yet done
        self._is_loaded = bytearray(SECONDS_PER_HOUR)
        self._slots: list[_Slot | None] = [None] * SECONDS_PER_HOUR
        self._unloaded = SortedSet(s for s, c in enumerate(self._counts) if c)
        self._unloaded_total = self._known
        self._active = SortedSet()  # loaded seconds with entries not handed out
        self._scheduled = 0
        self._late: list[tuple[int, int]] = []  # heap of (ms, entry) linked behind the cursor
        self._late_set: set[int] = set()
        self._inflight: dict[int, int] = {}  # entry_no -> ms_in_hour, handed out
        self._low = 0  # no second before it has open entries
        self._delivered: set[int] = set()
        self._skip: tuple[int, int, int] | None = None  # (second, done, limit) from skip_to
        self._loaded_any = False

    @classmethod
    def from_counts(cls, hour: int, counts: Sequence[int]) -> SecondWheel:
        """A wheel for ``hour`` from the per-second counts of its second-heads table."""
        return cls(hour, counts)

    @property
    def hour(self) -> int:
        return self._hour

    @property
    def start_ms(self) -> int:
        """Epoch ms of the hour's first millisecond."""
        return self._start

    # -- what the wheel knows ------------------------------------------------------

    def is_loaded(self, second: int) -> bool:
        """Whether ``second``'s chain is walked: arrivals then go to ``link``."""
        return bool(self._is_loaded[self._check_second(second)])

    def count(self, second: int) -> int:
        """Entries of ``second`` the wheel was told about (heads count plus arrivals)."""
        return self._counts[self._check_second(second)]

    def note_arrival(self, second: int) -> None:
        """A message was filed into a second whose chain is not loaded: count it. O(1)."""
        s = self._check_second(second)
        if self._is_loaded[s]:
            raise WheelError(f"note_arrival(second={s}): second is loaded, link() the entry")
        self._grow(s)
        self._unloaded.add(s)
        self._unloaded_total += 1

    def arrive_many(self, first_entry: int, ms_in_hour: Sequence[int]) -> list[int]:
        """Entries ``first_entry``, ``first_entry + 1``, ... filed at ``ms_in_hour``: each is
        ``link``-ed when its second is loaded, else counted as ``note_arrival`` does. Returns
        the linked ones' numbers. One loop for a filing step's entries of this hour."""
        if not ms_in_hour:
            return []
        if min(ms_in_hour) < 0 or max(ms_in_hour) >= HOUR_MS:
            raise WheelError(f"arrive_many: ms_in_hour outside 0..{HOUR_MS - 1}")
        if self._known + len(ms_in_hour) > NO_LIMIT or not 0 <= first_entry <= NO_LIMIT - len(ms_in_hour):
            raise WheelError(f"hour {self._hour}: holds at most {NO_LIMIT} entries (arrivals from entry {first_entry})")
        seconds = list(map(floordiv, ms_in_hour, repeat(SECOND_MS)))
        is_loaded = self._is_loaded
        per_second = Counter(seconds)
        loaded = {s for s in per_second if is_loaded[s]}
        for s in loaded:
            del per_second[s]
        # Those beyond what is loaded (most) counted per second, not per entry; then the rest
        # linked in entry order: each second's counts and chain are its own.
        self._count_unloaded(per_second)
        if not loaded:
            return []
        link = self._link
        linked = [e for e, s in enumerate(seconds, first_entry) if s in loaded]
        for e in linked:
            i = e - first_entry
            link(seconds[i], ms_in_hour[i], e)
        return linked

    def _count_unloaded(self, per_second: Counter[int]) -> None:
        """``note_arrival`` of ``per_second[s]`` entries into each unloaded second ``s`` at once."""
        if not per_second:
            return
        grow = self._grow
        for s, n in per_second.items():
            grow(s, n)
        self._unloaded_total += per_second.total()
        self._unloaded.update(per_second)

    def mark_delivered(self, entry_nos: Iterable[int]) -> None:
        """Entries found in the dispatch log: ``load_second`` will skip them."""
        self._delivered.update(entry_nos)

    def delivered(self) -> AbstractSet[int]:
        """Dispatch-logged entries no ``load_second`` has met yet (a live view: read it,
        never change it), so the scheduler need not read their records."""
        return self._delivered

    def skip_to(self, tick: Tick) -> None:
        """Start from a tick (restart, failover): what it claims done will not fire.

        Call before the first ``load_second``. If this wheel knows fewer entries than
        ``tick.limit`` (the index here lags the master's), ``tick.done`` is not applied:
        its count refers to entries this wheel has not seen, so applying it could skip
        an unsent one; that second is re-sent instead (at least once, never lost).
        """
        if self._loaded_any:
            raise WheelError("skip_to(): must come before the first load_second()")
        first = self._first_second
        if tick.second < first:
            return
        if tick.second >= first + SECONDS_PER_HOUR:
            for s in list(self._unloaded):
                self._drop_unloaded(s)
            return
        st = tick.second - first
        done = tick.done if tick.limit <= self._known else 0
        self._skip = (st, done, tick.limit)
        if tick.limit >= self._known:
            for s in list(self._unloaded.irange(maximum=st - 1)):
                self._drop_unloaded(s)

    def walk_floor(self, second: int) -> int:
        """Entry number below which ``second``'s chain walk may stop: those are done.

        Chains run newest to oldest, so entry numbers fall along the walk. 0 = walk all.
        """
        s = self._check_second(second)
        skip = self._skip
        if skip is not None and s < skip[0]:
            return skip[2]
        return 0

    # -- loading -------------------------------------------------------------------

    def seconds_to_load(self, now_ms: int, ahead_ms: int = DEFAULT_AHEAD_MS) -> list[int]:
        """Unloaded non-empty seconds (of the hour) starting by ``now_ms + ahead_ms``."""
        horizon = now_ms + ahead_ms - self._start
        if horizon < 0 or not self._unloaded:
            return []
        return list(self._unloaded.irange(maximum=min(horizon // SECOND_MS, SECONDS_PER_HOUR - 1)))

    def next_load_ms(self, ahead_ms: int = DEFAULT_AHEAD_MS) -> int | None:
        """When the next unloaded non-empty second should be walked, or None."""
        if not self._unloaded:
            return None
        return self._start + self._unloaded[0] * SECOND_MS - ahead_ms

    def load_second(self, second: int, entries: Iterable[tuple[int, int]]) -> None:
        """Take ``second``'s walked chain: ``(ms_in_hour, entry_no)`` pairs, any order.

        The pairs must be exactly the entries counted for the second (a mismatch means
        a lost or doubled entry and is refused), except that a walk may stop at
        ``walk_floor(second)``.
        """
        s = self._check_second(second)
        if self._is_loaded[s]:
            raise WheelError(f"load_second(second={s}): already loaded; link() later arrivals")
        expected = self._counts[s]
        floor = self.walk_floor(s)
        if floor == 0 and not self._delivered and (self._skip is None or self._skip[0] != s):
            groups: dict[int, list[int]] = {}
            for m, e in entries:  # the common case: nothing to skip
                g = groups.get(m)
                if g is None:
                    groups[m] = [e]
                else:
                    g.append(e)
            done_keys: list[int] = []
            dropped: list[int] = []
            given = -1  # counted from the groups below
        else:
            groups, done_keys, dropped, given = self._split_chain(s, entries, floor)
        times = sorted(groups)
        kept = 0
        for g in groups.values():
            g.sort()
            kept += len(g)
            if g[0] < 0 or g[-1] >= NO_LIMIT:
                bad = g[0] if g[0] < 0 else g[-1]
                raise WheelError(f"load_second(second={s}): entry_no={bad} outside 0..{NO_LIMIT - 1}")
        if given < 0:
            given = kept
        edges = [times[0], times[-1]] if times else []
        if done_keys:
            edges += [done_keys[0] >> 32, done_keys[-1] >> 32]
        base = s * SECOND_MS
        for ms in edges:
            if not base <= ms < base + SECOND_MS:
                raise WheelError(f"load_second(second={s}): ms_in_hour={ms} outside {base}..{base + SECOND_MS - 1}")
        if given > expected or (floor == 0 and given != expected):
            raise WheelError(f"load_second(second={s}): {given} entries given, the wheel counts {expected}")
        if dropped:
            self._delivered.difference_update(dropped)
        self._loaded_any = True
        self._is_loaded[s] = 1
        if expected:
            self._unloaded.discard(s)
            self._unloaded_total -= expected
        self._open[s] = kept
        self._scheduled += kept
        if times:
            self._slots[s] = _Slot(times, groups, done_keys)
            self._active.add(s)

    def _split_chain(
        self, s: int, entries: Iterable[tuple[int, int]], floor: int
    ) -> tuple[dict[int, list[int]], list[int], list[int], int]:
        """Restart path of ``load_second``: set apart what a tick or the dispatch log
        says is done. Returns (groups to fire, sorted done keys, dispatch-logged entry
        numbers seen, entries given)."""
        skip = self._skip
        tick_done, tick_limit = (skip[1], skip[2]) if skip is not None and skip[0] == s else (0, -1)
        delivered = self._delivered
        groups: dict[int, list[int]] = {}
        done_keys: list[int] = []
        dropped: list[int] = []
        low: list[int] = []
        given = 0
        for m, e in entries:
            given += 1
            if not 0 <= e < NO_LIMIT:
                raise WheelError(f"load_second(second={s}): entry_no={e} outside 0..{NO_LIMIT - 1}")
            if e < floor:
                done_keys.append(m << 32 | e)
            elif e < tick_limit:
                low.append(m << 32 | e)
            elif e in delivered:
                dropped.append(e)
                done_keys.append(m << 32 | e)
            else:
                groups.setdefault(m, []).append(e)
        # The tick's ``done`` counts positions among *all* entries below its limit, so
        # take those off in firing order first, then drop dispatch-logged ones.
        low.sort()
        done_keys.extend(low[:tick_done])
        for key in low[tick_done:]:
            m, e = key >> 32, key & _ENTRY_MASK
            if e in delivered:
                dropped.append(e)
                done_keys.append(key)
            else:
                groups.setdefault(m, []).append(e)
        done_keys.sort()
        return groups, done_keys, dropped, given

    def link(self, second: int, ms_in_hour: int, entry_no: int) -> None:
        """A message filed into a loaded second: put it in firing order at once.

        O(1) for the usual append (entry numbers grow); if its millisecond is already
        handed out it fires at the next ``pop_due`` (late, never skipped).
        """
        s = self._check_second(second)
        m, e = ms_in_hour, entry_no
        if not s * SECOND_MS <= m < (s + 1) * SECOND_MS:
            raise WheelError(f"link(second={s}): ms_in_hour={m} outside {s * SECOND_MS}..{(s + 1) * SECOND_MS - 1}")
        if not 0 <= e < NO_LIMIT:
            raise WheelError(f"link(second={s}): entry_no={e} outside 0..{NO_LIMIT - 1}")
        if not self._is_loaded[s]:
            raise WheelError(f"link(second={s}): second not loaded, note_arrival() it instead")
        self._link(s, m, e)

    def _link(self, s: int, m: int, e: int) -> None:
        """``link`` once its arguments are checked (``arrive_many`` checks a batch's at once)."""
        slot = self._slots[s]
        if slot is None:
            slot = self._slots[s] = _Slot([], {}, [])
        times = slot.times
        i = bisect_left(times, m)
        if i < len(times) and times[i] == m:
            g = slot.groups[m]
            if e > g[-1]:
                j = len(g)
                g.append(e)
            else:
                j = bisect_left(g, e)
                if g[j] == e:
                    raise WheelError(f"link(second={s}): entry_no={e} is already linked")
                g.insert(j, e)
            behind = i < slot.cursor
        else:
            j = 0
            times.insert(i, m)
            slot.groups[m] = [e]
            behind = i < slot.cursor
            if behind:
                slot.cursor += 1
        self._grow(s)
        self._scheduled += 1
        if behind:
            heapq.heappush(self._late, (m, e))
            self._late_set.add(e)
        else:
            self._active.add(s)
        if (i, j) < (slot.scan_group, slot.scan_index):
            slot.scan_group, slot.scan_index = i, j
            slot.scan_count = sum(len(slot.groups[t]) for t in times[:i]) + j

    # -- firing --------------------------------------------------------------------

    def next_due_ms(self) -> int | None:
        """Epoch ms to wake at: the next loaded entry, or the start of the next
        unloaded non-empty second (due means: load it), or None when nothing is left."""
        best = None
        if self._late:
            best = self._late[0][0]
        if self._active:
            slot = self._slots[self._active[0]]
            m = slot.times[slot.cursor]
            if best is None or m < best:
                best = m
        if self._unloaded:
            m = self._unloaded[0] * SECOND_MS
            if best is None or m < best:
                best = m
        return None if best is None else self._start + best

    def pop_due(self, now_ms: int) -> list[tuple[int, int]]:
        """Hand out every entry due at or before ``now_ms``: ``(deliver_at_ms, entry_no)``
        in firing order. They stay in flight until ``mark_done``."""
        now_in = now_ms - self._start
        if now_in < 0:
            return []
        start = self._start
        inflight = self._inflight
        out: list[tuple[int, int]] = []
        handed = 0
        last_s = min(now_in // SECOND_MS, SECONDS_PER_HOUR - 1)
        if self._unloaded and self._unloaded[0] <= last_s:
            last_s = self._unloaded[0] - 1  # keep order: that second must be walked first
        active = self._active
        slots = self._slots
        while active:
            s = active[0]
            if s > last_s:
                break
            slot = slots[s]
            times, groups = slot.times, slot.groups
            c, n = slot.cursor, len(times)
            while c < n:
                m = times[c]
                if m > now_in:
                    break
                g = groups[m]
                out.extend(zip(repeat(start + m), g))
                inflight.update(zip(g, repeat(m)))
                handed += len(g)
                c += 1
            slot.cursor = c
            if c < n:
                break
            active.remove(s)
        late = self._late
        if late and late[0][0] <= now_in:
            released = []
            while late and late[0][0] <= now_in:
                m, e = heapq.heappop(late)
                self._late_set.discard(e)
                inflight[e] = m
                released.append((start + m, e))
            handed += len(released)
            out = list(heapq.merge(released, out)) if out else released
        self._scheduled -= handed
        return out

    # -- confirming and the tick ---------------------------------------------------

    def mark_done(self, deliver_at_ms: int, entry_no: int) -> bool:
        """The realtime server accepted this handed-out entry. False if not in flight
        (already confirmed, or never handed out)."""
        return self.mark_done_many(((deliver_at_ms, entry_no),)) == 1

    def mark_done_many(self, items: Iterable[tuple[int, int]]) -> int:
        """``mark_done`` for each ``(deliver_at_ms, entry_no)``; how many were in flight (one
        loop: a confirm round marks a SEND's entries at once). An entry handed out for
        another time raises ``WheelError``, the entries before it marked."""
        inflight, open_, slots, start = self._inflight, self._open, self._slots, self._start
        done = 0
        for deliver_at_ms, entry_no in items:
            m = inflight.pop(entry_no, None)
            if m is None:
                continue
            if m != deliver_at_ms - start:
                inflight[entry_no] = m
                raise WheelError(
                    f"mark_done(entry_no={entry_no}): deliver_at_ms={deliver_at_ms}, it was handed out for {start + m}"
                )
            s = m // SECOND_MS
            left = open_[s] - 1
            open_[s] = left
            if left == 0:
                slots[s] = None  # all confirmed: free the second's entries
            done += 1
        return done

    def tick(self) -> Tick:
        """The fully confirmed prefix in firing order (see ``delaymq.wheel.tick``).

        When every known entry is done: the hour's last second with all its entries
        done, so the claim still stops at ``limit`` (never "the whole hour", which
        would cover entries filed later). The scheduler streams the tick of its
        earliest hour that is not done.
        """
        s, open_ = self._low, self._open
        while s < SECONDS_PER_HOUR and open_[s] == 0:
            s += 1
        self._low = s
        if s == SECONDS_PER_HOUR:
            last = SECONDS_PER_HOUR - 1
            return Tick(self._first_second + last, self._counts[last], self._known)
        slot = self._slots[s]
        done = 0 if slot is None or not self._is_loaded[s] else self._done_before_open(slot)
        return Tick(self._first_second + s, done, self._known)

    def pending(self) -> WheelCounts:
        return WheelCounts(self._unloaded_total, self._scheduled, len(self._inflight), self._known)

    def is_empty(self) -> bool:
        """Nothing left to hand out (entries may still be in flight)."""
        return self._unloaded_total == 0 and self._scheduled == 0

    def is_done(self) -> bool:
        """Everything handed out and confirmed: the hour can leave the hour wheel."""
        return self.is_empty() and not self._inflight

    def __repr__(self) -> str:
        return f"<SecondWheel hour={self._hour} {self.pending()}>"

    # -- internals -----------------------------------------------------------------

    def _check_second(self, second: int) -> int:
        if not isinstance(second, int) or not 0 <= second < SECONDS_PER_HOUR:
            raise WheelError(f"second={second!r}: must be a second of the hour, 0..{SECONDS_PER_HOUR - 1}")
        return second

    def _grow(self, s: int, n: int = 1) -> None:
        """``n`` more entries in second ``s`` (counted, not yet done)."""
        if self._known + n > NO_LIMIT:
            raise WheelError(f"hour {self._hour}: holds at most {NO_LIMIT} entries")
        self._known += n
        self._counts[s] += n
        self._open[s] += n
        if s < self._low:
            self._low = s

    def _drop_unloaded(self, s: int) -> None:
        """A not yet walked second that a tick says is wholly done."""
        self._is_loaded[s] = 1
        self._unloaded.discard(s)
        self._unloaded_total -= self._counts[s]
        self._open[s] = 0

    def _done_before_open(self, slot: _Slot) -> int:
        """How many of the second's entries, in order, precede its first unconfirmed one.

        Exact unless the second lost its memory (drained, or walked to a floor); then a
        lower bound, which is safe: a tick may claim too little, never too much.
        """
        times, groups, cursor = slot.times, slot.groups, slot.cursor
        inflight, late = self._inflight, self._late_set
        gi, ei, count = slot.scan_group, slot.scan_index, slot.scan_count
        n = len(times)
        key = None
        while gi < n:
            m = times[gi]
            g = groups[m]
            if gi >= cursor:
                key = m << 32 | g[ei]
                break
            glen = len(g)
            while ei < glen:
                e = g[ei]
                if e in inflight or e in late:
                    key = m << 32 | e
                    break
                ei += 1
                count += 1
            if key is not None:
                break
            gi += 1
            ei = 0
        slot.scan_group, slot.scan_index, slot.scan_count = gi, ei, count
        if key is None:
            return count + len(slot.done_keys)
        return count + bisect_left(slot.done_keys, key)


__all__ = ["DEFAULT_AHEAD_MS", "SecondWheel", "WheelCounts"]
