"""The dispatcher's loader: opens due hours, loads their seconds, reads records ahead.

It opens due hours (heads table + dispatch log -> ``SecondWheel``), walks the chains of
seconds about ``load_ahead_ms`` ahead and reads their records into the ``ReadAhead``
(within its byte budget), reads the records of arrivals linked into seconds already
loaded (one thread call for all hours, through readers kept open), and closes finished
hours. Every disk read runs through ``run_blocking`` (a worker thread).
"""

from __future__ import annotations

import logging
from collections.abc import Set as AbstractSet
from functools import partial

import trio

from delaymq.scheduler.delayindex import Heads
from delaymq.scheduler.dispatchcontext import DispatchContext
from delaymq.scheduler.hourlog import DamagedRecord, HourLog
from delaymq.scheduler.schedulelog import ScheduleStore
from delaymq.scheduler.wheelset import Load

log = logging.getLogger("delaymq.scheduler.dispatcher")


class Loader:
    """The loader task (``run``) and its counts."""

    def __init__(self, context: DispatchContext) -> None:
        self._store = context.store
        self._wheels = context.wheels
        self._clock = context.clock
        self._run_blocking = context.run_blocking
        self._read_ahead = context.read_ahead
        self._alarm = context.load_alarm
        self._fire_alarm = context.fire_alarm  # poked once something new may be due
        self.hours_opened = 0
        self.seconds_loaded = 0

    async def run(self) -> None:
        wheels = self._wheels
        while True:
            now = self._clock.now_ms()
            for hour in wheels.hours_to_close(now):
                wheels.close(hour)
                self._read_ahead.close_hour(hour)
            opening = wheels.hours_to_open(now)
            for hour in opening:
                await self._open_hour(hour)
            linked = wheels.take_linked()
            if linked:
                await self._read_linked(linked)
            loads = wheels.seconds_to_load(self._clock.now_ms())
            if loads:
                await self._load(loads)
                self._fire_alarm.poke()
                continue
            if opening:
                self._fire_alarm.poke()
                continue
            await self._alarm.wait(wheels.next_load_ms(self._clock.now_ms()))

    async def _open_hour(self, hour: int) -> None:
        self._wheels.begin_open(hour)
        try:
            with trio.CancelScope(shield=True):  # a reader opened in the thread must not leak
                reader, heads, delivered = await self._run_blocking(partial(_read_hour, self._store, hour))
        except BaseException:
            self._wheels.open_failed(hour)
            raise
        self._read_ahead.opened(hour, reader)
        self._wheels.opened(hour, heads.counts, heads.entries, delivered)
        self.hours_opened += 1
        if delivered:
            log.info(
                "hour %s: %d of %d entries were delivered before; skipping them",
                reader.name,
                len(delivered),
                heads.entries,
            )

    async def _load(self, loads: list[Load]) -> None:
        """Walk the chains of ``loads`` (one thread call per hour) and read their records."""
        by_hour: dict[int, list[Load]] = {}
        for load in loads:
            by_hour.setdefault(load.hour, []).append(load)
        for hour, group in by_hour.items():
            await self._load_hour(hour, group)

    async def _load_hour(self, hour: int, group: list[Load]) -> None:
        wheels = self._wheels
        read_ahead = self._read_ahead
        reader = read_ahead.readers[hour]
        with_records = read_ahead.has_room()
        wheels.begin_load(group)
        try:
            chains, records, damaged = await self._run_blocking(
                # The wheel's delivered set: only this (loader) task changes it, in
                # ``loaded`` below, so the thread may read it while we wait.
                partial(_walk, reader, group, wheels.delivered(hour), with_records)
            )
        except BaseException:
            for load in group:
                wheels.load_failed(load)
            raise
        for i, (load, chain) in enumerate(zip(group, chains)):
            try:
                wheels.loaded(load, chain)
            except BaseException:
                for rest in group[i + 1 :]:
                    wheels.load_failed(rest)
                raise
        self.seconds_loaded += len(group)
        if records:
            read_ahead.add(hour, records)
            read_ahead.note_damaged(damaged)

    async def _read_linked(self, linked: dict[int, list[int]]) -> None:
        """Read the records of arrivals linked into loaded seconds (one thread call), so
        the firer finds them in memory. Within the cache budget; what is not read here
        (or is fired before the read ends) the firer reads itself."""
        read_ahead = self._read_ahead
        if not read_ahead.has_room():
            return
        wanted: dict[int, list[int]] = {}
        for hour, entries in linked.items():
            cache = read_ahead.records.get(hour)
            if cache is None or hour not in read_ahead.readers:
                continue
            missing = [entry for entry in entries if entry not in cache]
            if missing:
                wanted[hour] = missing
        if not wanted:
            return
        read_ahead.reading = reading = {hour: set(entries) for hour, entries in wanted.items()}
        try:
            readers = {hour: read_ahead.readers[hour] for hour in wanted}
            got, damaged = await self._run_blocking(partial(_read_many, readers, wanted))
        finally:
            read_ahead.reading = {}
        for hour, records in got.items():
            still = reading[hour]  # not fired meanwhile
            cache = read_ahead.records[hour]
            size = count = 0
            for entry, record in zip(wanted[hour], records):
                if entry in still:
                    cache[entry] = record
                    size += len(record)
                    count += 1
            read_ahead.records_held += count
            read_ahead.bytes_held += size
        read_ahead.note_damaged([record for record in damaged if record.entry in reading[record.hour]])


# ---------------------------------------------------------------------- blocking parts


def _read_hour(store: ScheduleStore, hour: int) -> tuple[HourLog, Heads, set[int]]:
    """Open a reader of ``hour``, its heads snapshot and its delivered set (in a thread)."""
    reader = store.open_hour(hour)
    try:
        heads = reader.heads()
        delivered = store.delivered(hour)
    except BaseException:
        reader.close()
        raise
    return reader, heads, delivered


def _walk(
    reader: HourLog, loads: list[Load], skip: AbstractSet[int], with_records: bool
) -> tuple[list[list[tuple[int, int]]], dict[int, bytes], list[DamagedRecord]]:
    """Walk each second's chain; read the records of entries not delivered yet (one that does
    not check is ``b""``, and said why in the list)."""
    chains = [reader.chain(load.second, below=load.below, floor=load.floor) for load in loads]
    damaged: list[DamagedRecord] = []
    if not with_records:
        return chains, {}, damaged
    if skip:
        wanted = [entry for chain in chains for _ms, entry in chain if entry not in skip]
    else:
        wanted = [entry for chain in chains for _ms, entry in chain]
    return chains, dict(zip(wanted, reader.read_records(wanted, damaged=damaged))), damaged


def _read_many(
    readers: dict[int, HourLog], wanted: dict[int, list[int]]
) -> tuple[dict[int, list[bytes]], list[DamagedRecord]]:
    """The records of ``wanted`` entries, per hour, through the loader's readers (and those that did not check)."""
    damaged: list[DamagedRecord] = []
    got = {hour: readers[hour].read_records(entries, damaged=damaged) for hour, entries in wanted.items()}
    return got, damaged


__all__ = ["Loader"]
