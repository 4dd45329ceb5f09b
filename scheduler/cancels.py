"""What a master keeps in memory for CANCEL, MOVE, QUERY and the SCHEDULE duplicate check.

The truth is the message log (CANCEL and MOVE records, ``delaymq.scheduler.idindex``)
and, once replay filed it, the lmdb id index and the dispatch logs. Memory holds what
they do not say yet (docs/cancel.md):

- ``Tail``: the state of each index key the message log's unfiled tail sets (scheduled
  at ``deliver_at``, or cancelled), so a SCHEDULE of an id accepted a moment ago is a
  duplicate and a QUERY sees it; plus the keys being appended right now. A filed entry
  stays a little longer while a lookup that started before its filing runs
  (``begin_lookup``), so no lookup misses it both in lmdb and here.
- ``Holds``: the entries a cancel (or move) holds back from firing: while it is made
  durable (then a handed-out entry is parked; ``release`` gives it back to fire if the
  write failed), and once durable until replay has filed the cancel (lmdb
  ``scheduler.cancelled``, which an hour's done entries include) and the wheel can no
  longer hand the entry out. The dispatcher calls
  ``skip`` with every hour's due entries before they reach a lane.
- ``RecentDispatches``: when the last dispatches were accepted (``dispatched_at``), bounded.

The rule (the single event loop decides when it takes the cancel): an entry already
handed to a lane, or in the dispatch log, is delivered; any other is cancelled, and
from that moment it is never handed out unless the cancel's write fails.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice, repeat
from operator import is_
from typing import ClassVar, NamedTuple, Protocol

from delaymq.scheduler.idindex import SCHEDULED, IdEntry, lookup
from delaymq.scheduler.schedulelog import ScheduleStore
from delaymq.scheduler.wheelset import Due, WheelSet
from delaymq.wheel import hour_of
from delaymq.wheel.alarm import Alarm

PENDING = 0  # the cancel is being made durable
DURABLE = 1  # the cancel is in the message log (and replicated as the policy asks)

#: ``dispatched_at`` is remembered for this many of the latest dispatches.
RECENT_DISPATCHES = 100_000


class TailEntry(NamedTuple):
    """What the unfiled tail says of one index key (a SCHEDULE's records: ``ScheduledBatch``)."""

    deliver_at: int
    source: int  # message-log offset of the record that set it
    end: int  # message-log offset after that record: filed once the checkpoint reaches it
    state: int  # idindex.SCHEDULED or idindex.CANCELLED
    key_hash: bytes | None

    def entry(self, key: str) -> TailEntry:
        """Itself: what the tail holds for ``key`` answers ``entry`` alike, a batch or an entry."""
        return self


@dataclass(frozen=True, slots=True, eq=False)
class ScheduledBatch:
    """The records one SCHEDULE appended, held once in the tail for all its keys: a batch
    costs one object, not a ``TailEntry`` per record; ``entry`` makes a key's when asked
    (a CANCEL, MOVE or QUERY of a record not filed yet, or a retried id)."""

    keys: list[str]  # index keys, in log order
    deliver_ats: Sequence[int]  # when each is filed (``max(deliver_at, now)``)
    key_hashes: Sequence[bytes | None]
    kept: Sequence[int]  # which records of the received batch were appended, in log order
    starts: Sequence[int]  # where each record of the received batch starts, and ends
    ends: Sequence[int]
    offset: int  # message-log offset of the first appended record
    end: int  # message-log offset after the last: filed once the checkpoint reaches it
    state: ClassVar[int] = SCHEDULED

    def entry(self, key: str) -> TailEntry:
        i = self.keys.index(key)
        starts, ends = self.starts, self.ends
        source = self.offset + sum(ends[k] - starts[k] for k in self.kept[:i])
        return TailEntry(self.deliver_ats[i], source, self.end, SCHEDULED, self.key_hashes[i])


#: What the tail holds per key: a CANCEL's or MOVE's entry, or the SCHEDULE batch that set it.
Held = TailEntry | ScheduledBatch


class Tail:
    """Index keys set by records of the message log that replay has not filed yet."""

    def __init__(self) -> None:
        self.ids: dict[str, Held] = {}
        self.keys: dict[bytes, set[str]] = {}
        self._unfiled: deque[tuple[int, list[tuple[str, TailEntry]] | ScheduledBatch]] = deque()
        self._retired: deque[tuple[int, list[tuple[str, TailEntry]] | ScheduledBatch]] = deque()
        self._epoch = 0
        self._lookups: Counter[int] = Counter()

    def add(self, entries: list[tuple[str, TailEntry]] | ScheduledBatch, end: int) -> None:
        """Records up to message-log offset ``end`` set these keys (appended, in log order)."""
        keys = self.keys
        if isinstance(entries, ScheduledBatch):
            self.ids.update(zip(entries.keys, repeat(entries)))
            if entries.key_hashes.count(None) != len(entries.key_hashes):
                for key, hashed in zip(entries.keys, entries.key_hashes):
                    if hashed is not None:
                        keys.setdefault(hashed, set()).add(key)
        else:
            self.ids.update(entries)
            for key, entry in entries:
                if entry.key_hash is not None:
                    keys.setdefault(entry.key_hash, set()).add(key)
        self._unfiled.append((end, entries))

    def unfiled(self, key: str, checkpoint: int) -> TailEntry | None:
        """The tail's word on ``key`` if replay has not filed it (None: ask the index)."""
        held = self.ids.get(key)
        if held is None or held.end <= checkpoint:
            return None
        return held.entry(key)

    def with_key(self, hashed: bytes) -> list[str]:
        return [key for key in self.keys.get(hashed, ()) if self.ids[key].entry(key).key_hash == hashed]

    def filed(self, checkpoint: int) -> None:
        """Replay filed everything below ``checkpoint``."""
        while self._unfiled and self._unfiled[0][0] <= checkpoint:
            self._retired.append((self._epoch, self._unfiled.popleft()[1]))
        self._epoch += 1
        self._expire()

    def begin_lookup(self) -> int:
        self._lookups[self._epoch] += 1
        return self._epoch

    def end_lookup(self, epoch: int) -> None:
        self._lookups[epoch] -= 1
        if not self._lookups[epoch]:
            del self._lookups[epoch]
        self._expire()

    def __len__(self) -> int:
        return len(self.ids)

    def _expire(self) -> None:
        oldest = min(self._lookups) if self._lookups else self._epoch + 1
        retired, ids = self._retired, self.ids
        while retired and retired[0][0] < oldest:
            entries = retired.popleft()[1]
            held_keys: Iterable[tuple[str, Held, bytes | None]]
            if isinstance(entries, ScheduledBatch):
                keys, hashes = entries.keys, entries.key_hashes
                if all(map(is_, map(ids.get, keys), repeat(entries))) and hashes.count(None) == len(keys):
                    deque(map(ids.__delitem__, keys), 0)  # the common case: no key set again since
                    continue
                held_keys = zip(keys, repeat(entries), hashes)
            else:
                held_keys = ((key, entry, entry.key_hash) for key, entry in entries)
            for key, held, hashed in held_keys:
                if ids.get(key) is held:
                    del ids[key]
                    if hashed is not None:
                        same = self.keys.get(hashed)
                        if same is not None:
                            same.discard(key)
                            if not same:
                                del self.keys[hashed]


class Firing(Protocol):
    """What ``Holds`` needs of the dispatcher."""

    load_alarm: Alarm

    async def hand_out(self, due: Due) -> None: ...


@dataclass(slots=True)
class Hold:
    """One entry held back by a cancel."""

    hour: int
    entry: int
    state: int = PENDING
    source: int = -1  # the cancel record's message-log offset, once durable
    parked: list[int] = field(default_factory=list)  # deliver_at of each hand-out held back
    passed: bool = False  # handed out and confirmed done in the wheel without being sent


class Holds:
    """The entries cancels hold back from firing, per hour."""

    def __init__(self, wheels: WheelSet, firing: Firing) -> None:
        self._wheels = wheels
        self._firing = firing
        self._held: dict[int, dict[int, Hold]] = {}

    def __len__(self) -> int:
        return sum(map(len, self._held.values()))

    def get(self, hour: int, entry: int) -> Hold | None:
        held = self._held.get(hour)
        return None if held is None else held.get(entry)

    def hold(self, hour: int, entry: int) -> Hold:
        held = self._held.setdefault(hour, {})
        got = held.get(entry)
        if got is None:
            got = held[entry] = Hold(hour, entry)
        return got

    def skip(self, hour: int, items: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The dispatcher's hook: ``items`` (due ``(deliver_at, entry)`` of ``hour``) less the held
        ones. A durably cancelled entry is marked done in the wheel; a pending one is parked."""
        held = self._held.get(hour)
        if not held:
            return items
        keep: list[tuple[int, int]] = []
        done: list[tuple[int, int]] = []
        for at, entry in items:
            hold = held.get(entry)
            if hold is None:
                keep.append((at, entry))
            elif hold.state == DURABLE:
                done.append((at, entry))
                hold.passed = True
            else:
                hold.parked.append(at)
        if done:
            self._done(hour, done)
        return keep

    def settle(self, holds: Iterable[Hold], source: int) -> None:
        """The cancel record at ``source`` is durable: what it parked is done, without a send."""
        for hold in holds:
            hold.state = DURABLE
            hold.source = source
            if hold.parked:
                self._done(hold.hour, [(at, hold.entry) for at in hold.parked])
                hold.parked = []
                hold.passed = True

    async def release(self, holds: Iterable[Hold]) -> None:
        """The cancel's write failed: let the entries fire (what was parked goes out now)."""
        due: dict[int, list[tuple[int, int]]] = {}
        for hold in holds:
            held = self._held.get(hold.hour)
            if held is not None and held.get(hold.entry) is hold:
                del held[hold.entry]
                if not held:
                    del self._held[hold.hour]
            due.setdefault(hold.hour, []).extend((at, hold.entry) for at in hold.parked)
            hold.parked = []
        out = [(hour, sorted(items)) for hour, items in sorted(due.items()) if items]
        if out:
            await self._firing.hand_out(out)

    def prune(self, checkpoint: int, now_ms: int) -> None:
        """Forget holds the store now covers: their cancel is filed (below ``checkpoint``)
        and the wheel cannot hand the entry out any more (it did, and was told it is done; or
        the hour is not open and will read its done entries when it opens)."""
        if not self._held:
            return
        wheels = self._wheels
        hours = set(wheels.hours())
        far = hour_of(now_ms + wheels.hour_preload_ms) + 1
        for hour in list(self._held):
            held = self._held[hour]
            closed = wheels.wheel(hour) is None and (hour not in hours or hour > far)
            for entry in [e for e, h in held.items() if h.state == DURABLE and 0 <= h.source < checkpoint]:
                if held[entry].passed or closed:
                    del held[entry]
            if not held:
                del self._held[hour]

    def _done(self, hour: int, items: list[tuple[int, int]]) -> None:
        self._wheels.confirm(hour, items)
        self._firing.load_alarm.poke()


def handed_out(wheels: WheelSet, hour: int, entry: int) -> bool:
    """Whether the wheel handed ``entry`` out and it is not confirmed yet (in a lane, being sent,
    or being recorded in the dispatch log)."""
    wheel = wheels.wheel(hour)
    if wheel is None:
        return False
    return entry in wheel._inflight


def look_up(store: ScheduleStore, keys: list[str]) -> list[tuple[IdEntry | None, bool]]:
    """Each index key's value and whether its entry is in its hour's dispatch log (delivered;
    a cancelled one says so in its value). Blocking (lmdb and dispatch logs); the master calls it in a thread first
    and then once more on the event loop, where it decides, finding the pages in memory."""
    values = lookup(store.state, keys)
    if not any(values):  # none in the index (new ids): nothing to look up in dispatch logs
        return [(None, False)] * len(values)
    by_hour: dict[int, list[int]] = {}
    for value in values:
        if value is not None and value.state == SCHEDULED:
            by_hour.setdefault(value.hour, []).append(value.entry)
    logged: set[tuple[int, int]] = set()
    for hour, entries in by_hour.items():
        logged.update((hour, e) for e, done in zip(entries, store.delivered_among(hour, entries)) if done)
    return [(v, v is not None and (v.hour, v.entry) in logged) for v in values]


class RecentDispatches:
    """When realtime accepted the latest ``RECENT_DISPATCHES`` dispatches (epoch ms), or a
    quarter more: the oldest are let go a quarter at a time (one dict copy, not one pop each)."""

    def __init__(self, size: int = RECENT_DISPATCHES) -> None:
        self._size = size
        self._at: dict[int, int] = {}  # insertion-ordered: the oldest first

    def recorded(self, rounds: dict[int, list[int]], now_ms: int) -> None:
        at = self._at
        for hour, entries in rounds.items():
            base = hour << 32
            at.update(dict.fromkeys([base | entry for entry in entries], now_ms))
        if len(at) > self._size + self._size // 4:
            self._at = dict(islice(at.items(), len(at) - self._size, None))

    def get(self, hour: int, entry: int) -> int | None:
        return self._at.get(hour << 32 | entry)


__all__ = [
    "DURABLE",
    "PENDING",
    "Hold",
    "Holds",
    "RecentDispatches",
    "Tail",
    "TailEntry",
    "ScheduledBatch",
    "handed_out",
    "look_up",
]
