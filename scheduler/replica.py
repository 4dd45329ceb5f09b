"""What a scheduler slave keeps besides the log: the master's dispatch records and tick.

The master's confirmer records each round of accepted entries in its dispatch logs,
then adds the round to the replication journal (``ReplicationSource.journal_append``)
as ``dispatch_record`` payloads; a slave that asks from a position the journal no
longer covers gets ``snapshot_records`` (every hour the master holds: its delivered
entries, or "all of its first n" for a finished hour).

A slave files the log on its own schedule, so a record may name entries it has not
filed yet; ``DispatchRecords`` keeps those in memory and writes them to its dispatch
logs once replay has filed their entries (``settle``). Entry numbers agree because
master and slave file the same bytes with the same code. What is still unfiled when
the slave is promoted names entries it never received (the old master's unreplicated
tail): ``drop`` counts them.
"""

from __future__ import annotations

import struct
import threading
from array import array
from collections.abc import Iterable
from dataclasses import dataclass

from delaymq.scheduler.dispatchlog import pack_entries, unpack_entries
from delaymq.scheduler.schedulelog import ScheduleStore
from delaymq.wheel import Tick

_HEAD = struct.Struct(">Bq")
_DISPATCH = ord("d")  # entry numbers follow as a dispatch log's payload (``pack_entries``)
_FINISHED = ord("f")  # a u32 count follows: entries 0 .. count-1 are all delivered
_COUNT = struct.Struct(">I")


def dispatch_record(hour: int, entries: Iterable[int]) -> bytes:
    return _HEAD.pack(_DISPATCH, hour) + pack_entries(array("I", entries))


def finished_record(hour: int, count: int) -> bytes:
    return _HEAD.pack(_FINISHED, hour) + _COUNT.pack(count)


def decode_record(payload: bytes) -> tuple[int, Iterable[int]]:
    """``(hour, entry numbers)`` of a journal payload; ValueError on anything else."""
    if len(payload) < _HEAD.size:
        raise ValueError(f"dispatch journal record of {len(payload)} bytes is too short")
    kind, hour = _HEAD.unpack_from(payload)
    rest = payload[_HEAD.size :]
    if kind == _FINISHED and len(rest) == _COUNT.size:
        return hour, range(_COUNT.unpack(rest)[0])
    if kind == _DISPATCH and len(rest) % 4 == 0:
        return hour, unpack_entries(rest)
    raise ValueError(f"dispatch journal record of kind {kind} and {len(rest)} bytes is malformed")


def snapshot_records(store: ScheduleStore) -> list[bytes]:
    """Every hour the master holds, as journal records (blocking: reads dispatch logs)."""
    records = []
    for hour in store.hours_with_messages():
        if store.is_complete(hour):
            records.append(finished_record(hour, store.entries(hour)))
        else:
            delivered = store.delivered(hour)
            if delivered:
                records.append(dispatch_record(hour, sorted(delivered)))
    return records


class DispatchRecords:
    """The master's dispatch records on a slave: filed ones written, the rest held."""

    def __init__(self, store: ScheduleStore) -> None:
        self._store = store
        self._held: dict[int, set[int]] = {}
        self.written = 0
        # The fetcher's journal and the replay loop settle from two worker threads.
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        return sum(map(len, self._held.values()))

    def take(self, payloads: Iterable[bytes]) -> int:
        """Write what can be (blocking; fsyncs once), hold the rest; returns entries newly written."""
        decoded = [decode_record(payload) for payload in payloads]
        with self._lock:
            for hour, entries in decoded:
                self._held.setdefault(hour, set()).update(entries)
            return self._settle(None)

    def settle(self, hours: Iterable[int] | None = None) -> int:
        """Write the held entries replay has filed since (blocking)."""
        with self._lock:
            return self._settle(hours)

    def _settle(self, hours: Iterable[int] | None) -> int:
        store = self._store
        new = 0
        for hour in list(self._held if hours is None else hours):
            held = self._held.get(hour)
            if not held:
                continue
            filed = store.entries(hour)
            ready = [entry for entry in held if entry < filed]
            if ready:
                new += store.record_dispatched(hour, ready)
                held.difference_update(ready)
            if not held:
                del self._held[hour]
        if new:
            store.flush_dispatched()
            self.written += new
        return new

    def drop(self) -> int:
        """Forget what this member never filed (promotion); returns how many entries."""
        with self._lock:
            count = self.held
            self._held.clear()
        return count


@dataclass(frozen=True, slots=True)
class MasterTick:
    """The master's tick as a slave last heard it."""

    tick: Tick
    master_now_ms: int  # the master's wall clock when it sent it
    received_ms: int  # this slave's monotonic clock when it arrived
    master_durable_end: int


__all__ = ["DispatchRecords", "MasterTick", "decode_record", "dispatch_record", "finished_record", "snapshot_records"]
