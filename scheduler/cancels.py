"""What a master keeps in memory for CANCEL, MOVE, QUERY and the SCHEDULE duplicate check.

The truth is the message log (CANCEL and MOVE records, ``delaymq.scheduler.idindex``)
and, once replay filed it, the lmdb id index and the dispatch logs. Memory holds what
they do not say yet (docs/cancel.md):

- ``Tail``: the state of each index key the message log's unfiled tail sets (scheduled
  at ``deliver_at``, or cancelled), so a SCHEDULE of an id accepted a moment ago is a
  duplicate and a QUERY sees it; plus the keys being appended right now. A filed entry
  stays a little longer while a lookup that started before its filing runs
  (``begin_lookup``), so no lookup misses it both in lmdb and here. It knows each
  message's subject and moves a message whose id a later one of another subject takes
  to its displaced key, as filing will (``delaymq.scheduler.idindex``); ``fresh_records``
  decides duplicates per (subject, id) from it and the index (``look_up_fresh``).
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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import islice, repeat
from operator import is_
from typing import ClassVar, NamedTuple, Protocol

from delaymq.clock import Alarm
from delaymq.scheduler.idindex import (
    DISPLACED_DB,
    SCHEDULED,
    IdEntry,
    displaced_key,
    filed_subjects,
    lookup,
)
from delaymq.scheduler.schedulelog import ScheduleStore
from delaymq.scheduler.wheelset import Due, WheelSet
from delaymq.wheel import hour_of

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
    subject: str | None = None  # of the message; None under a displaced key (the key names it)
    #: Under a displaced key: the index knows the message itself (filed, maybe delivered since)
    #: once the checkpoint reaches this; 0: at ``end``.
    record_end: int = 0

    def entry(self, key: str) -> TailEntry:
        """Itself: what the tail holds for ``key`` answers ``entry`` alike, a batch or an entry."""
        return self

    def subject_of(self, key: str) -> str | None:
        return self.subject


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
    subjects: Sequence[str] | None = None  # each record's subject, in log order
    #: Each record's message-log offset when LATE records wrap some (None: end to end from ``offset``).
    sources: Sequence[int] | None = None
    #: Index of each key's last record (an id may come twice, under two subjects), made when first asked.
    positions: dict[str, int] = field(default_factory=dict, compare=False, repr=False)
    state: ClassVar[int] = SCHEDULED

    def entry(self, key: str) -> TailEntry:
        return self.entry_at(self.position(key))

    def entry_at(self, i: int) -> TailEntry:
        if self.sources is not None:
            source = self.sources[i]
        else:
            starts, ends = self.starts, self.ends
            source = self.offset + sum(ends[k] - starts[k] for k in self.kept[:i])
        subject = self.subjects[i] if self.subjects is not None else None
        return TailEntry(self.deliver_ats[i], source, self.end, SCHEDULED, self.key_hashes[i], subject)

    def position(self, key: str) -> int:
        positions = self.positions
        if not positions:
            positions.update(zip(self.keys, range(len(self.keys))))
        return positions[key]

    def subject_of(self, key: str) -> str | None:
        return self.subjects[self.position(key)] if self.subjects is not None else None


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

    def add(self, entries: list[tuple[str, TailEntry]] | ScheduledBatch, end: int, *, overlap: bool = True) -> None:
        """Records up to message-log offset ``end`` set these keys (appended, in log order).
        ``overlap`` False: no key of the batch is in the tail nor twice in it (nothing moves)."""
        keys = self.keys
        if overlap:
            self._displace(entries, end)
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

    def _displace(self, entries: list[tuple[str, TailEntry]] | ScheduledBatch, end: int) -> None:
        """Where an id the records take was held by a message of another subject (in the tail,
        or earlier among them), that message moves to its displaced key, as filing will move
        it: that entry is filed with these records (``end``)."""
        ids = self.ids
        entry_at: Callable[[int], TailEntry]
        items: list[tuple[str, str | None]]
        if isinstance(entries, ScheduledBatch):
            if entries.subjects is None:
                return
            items = list(zip(entries.keys, entries.subjects))
            entry_at = entries.entry_at
        else:
            items = [(key, entry.subject) for key, entry in entries]
            entry_at = [entry for _key, entry in entries].__getitem__
        latest: dict[str, int] = {}  # id -> its latest record among these so far
        for i, (key, subject) in enumerate(items):
            if subject is None or "\x00" in key:
                continue
            j = latest.get(key)
            latest[key] = i
            before: Callable[[], TailEntry]
            if j is not None:
                holder, before = items[j][1], partial(entry_at, j)
            else:
                held = ids.get(key)
                if held is None:
                    continue
                holder, before = held.subject_of(key), partial(held.entry, key)
            if holder is None or holder == subject:
                continue
            moved = before()
            own = moved.record_end or moved.end
            self._put(displaced_key(key, holder), moved._replace(end=end, subject=None, record_end=own), end)

    def _put(self, key: str, entry: TailEntry, end: int) -> None:
        self.ids[key] = entry
        if entry.key_hash is not None:
            self.keys.setdefault(entry.key_hash, set()).add(key)
        self._unfiled.append((end, [(key, entry)]))

    def state_of(self, key: str, subject: str | None, checkpoint: int) -> int | None:
        """The tail's word on the message (``subject``, id ``key``): SCHEDULED, CANCELLED, or None
        (ask the index, read from ``checkpoint`` on). ``subject`` None: on whatever message holds
        ``key``. A message another subject's record took the id from answers only until its own
        record is filed: it may be delivered since, which the index knows."""
        held = self.ids.get(key)
        if held is None:
            return None
        if subject is not None:
            holder = held.subject_of(key)
            if holder is not None and holder != subject:
                moved = self.ids.get(displaced_key(key, subject))
                if moved is None or 0 < moved.record_end <= checkpoint:  # type: ignore[union-attr]
                    return None
                return moved.state
        return held.state

    def unfiled(self, key: str, checkpoint: int) -> TailEntry | None:
        """The tail's word on ``key`` if replay has not filed it (None: ask the index)."""
        held = self.ids.get(key)
        if held is None or held.end <= checkpoint:
            return None
        return held.entry(key)

    def with_key(self, hashed: bytes) -> list[str]:
        ids = self.ids
        return [key for key in self.keys.get(hashed, ()) if key in ids and ids[key].entry(key).key_hash == hashed]

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
                    deque(map(ids.pop, keys, repeat(None)), 0)  # the common case: no key set again since
                    continue
                held_keys = zip(keys, repeat(entries), hashes)
            else:
                held_keys = ((key, entry, entry.key_hash) for key, entry in entries)
            gone: set[str] = set()  # an id may come twice in a batch (two subjects), each with its key
            for key, held, hashed in held_keys:
                if ids.get(key) is held:
                    del ids[key]
                    gone.add(key)
                if hashed is not None and key in gone:
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


#: The index's word on each record of a SCHEDULE: the value of its (subject, id) and whether
#: its entry is delivered; None for the whole batch when no key can be in the index.
Found = list[tuple[IdEntry | None, bool]] | None


def fresh_records(
    tail: Tail, keys: list[str], subjects: Sequence[str], found: Found, checkpoint: int
) -> tuple[list[bool], bool]:
    """Which records of a SCHEDULE are new, and whether any key was in the tail or came twice.

    A record is a duplicate if its (subject, id) is scheduled and not delivered: in the
    unfiled tail (``Tail.state_of``) or else in the index (``found``, ``look_up_fresh``, read
    from ``checkpoint`` on), or came earlier in the batch. The same id on another subject
    is another message (a retry's key names its subject already)."""
    ids = tail.ids
    if ids.keys().isdisjoint(keys) and len(set(keys)) == len(keys):
        # The common case: no key in the tail, none twice: the index alone decides.
        if found is None:
            return [True] * len(keys), False
        return [value is None or value.state != SCHEDULED or logged for value, logged in found], False
    fresh = []
    seen: set[tuple[str, str | None]] = set()
    for i, k in enumerate(keys):
        subject = subjects[i] if "\x00" not in k else None
        if (k, subject) in seen:
            fresh.append(False)
            continue
        seen.add((k, subject))
        state = tail.state_of(k, subject, checkpoint)
        if state is not None:
            fresh.append(state != SCHEDULED)
            continue
        value, logged = (None, False) if found is None else found[i]
        fresh.append(value is None or value.state != SCHEDULED or logged)
    return fresh, True


def look_up_fresh(store: ScheduleStore, keys: list[str], subjects: Sequence[str]) -> Found:
    """The index's word on each record's (subject, id): its id's value if the message holding
    the id is of that subject, otherwise that of its displaced key, and whether it is
    delivered. The holder's record is read only for an id scheduled and not delivered (is it
    this subject's duplicate?); a displaced key only when the index may hold one for the id.
    Blocking, like ``look_up``."""
    found = look_up(store, keys)
    state = store.state
    try:
        highest = state.highest_key(DISPLACED_DB)
    except KeyError:
        highest = b"\xff"
    if not highest and not any(value for value, _logged in found):
        return found  # no id indexed, and no message ever displaced
    ask: list[int] = []  # records whose (subject, id) may be under a displaced key
    held: list[int] = []  # records whose id a message scheduled and not delivered holds
    for i, (value, logged) in enumerate(found):
        k = keys[i]
        if "\x00" in k:
            continue
        if value is not None and value.state == SCHEDULED and not logged:
            held.append(i)
        elif highest and k.encode() + b"\x00\x00" <= highest:
            ask.append(i)
    if held:
        holders = filed_subjects(store.directory, [found[i][0] for i in held])  # type: ignore[misc]
        for i, holder in zip(held, holders):
            if holder is not None and holder != subjects[i].encode():  # another subject's message
                found[i] = (None, False)
                ask.append(i)
    if ask:
        moved = lookup(state, [displaced_key(keys[i], subjects[i]) for i in ask])
        for i, value in zip(ask, moved):
            if value is not None:
                found[i] = (value, _delivered(store, value))
    return found


def _delivered(store: ScheduleStore, value: IdEntry) -> bool:
    return value.state == SCHEDULED and store.delivered_among(value.hour, [value.entry])[0]


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
    "fresh_records",
    "handed_out",
    "look_up",
    "look_up_fresh",
]
