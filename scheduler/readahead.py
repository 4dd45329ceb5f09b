"""The dispatcher's records read ahead: what the loader read for the firer, per open hour.

The loader fills it (seconds about to fall due, arrivals linked into loaded seconds) within
``max_bytes``; the firer takes from it what it hands to the lanes and reads the rest itself,
through its own readers (the loader's may be in use in another thread). Both run on the
event loop, so the counts need no lock. A record that did not check when read is held as
``b""``, and what was wrong with it in ``damaged`` until the firer takes it.
"""

from __future__ import annotations

from delaymq.scheduler.hourlog import DamagedRecord, HourLog


class ReadAhead:
    """Hour -> entry -> record read ahead, with the readers it was read through."""

    __slots__ = (
        "records", "bytes_held", "records_held", "max_bytes", "reading", "readers", "fire_readers", "damaged",
    )  # fmt: skip

    def __init__(self, max_bytes: int) -> None:
        #: Hour -> entry -> record, read ahead and not handed out yet.
        self.records: dict[int, dict[int, bytes]] = {}
        self.bytes_held = 0  # of the records read ahead
        self.records_held = 0
        self.max_bytes = max_bytes
        #: Linked entries the loader is reading right now; the firer drops those it fires.
        self.reading: dict[int, set[int]] = {}
        self.readers: dict[int, HourLog] = {}  # the loader's, per open hour
        self.fire_readers: dict[int, HourLog] = {}  # the firer's, opened when it must read
        #: Hour -> entry -> what was wrong with its record (held as ``b""``), until it is fired.
        self.damaged: dict[int, dict[int, DamagedRecord]] = {}

    def has_room(self) -> bool:
        return self.bytes_held < self.max_bytes

    def opened(self, hour: int, reader: HourLog) -> None:
        """The loader opened ``hour`` through ``reader``."""
        self.readers[hour] = reader
        self.records.setdefault(hour, {})

    def add(self, hour: int, records: dict[int, bytes]) -> None:
        self.records[hour].update(records)
        self.records_held += len(records)
        self.bytes_held += sum(map(len, records.values()))

    def note_damaged(self, found: list[DamagedRecord]) -> None:
        """These records did not check when read (each held as ``b""``)."""
        for record in found:
            self.damaged.setdefault(record.hour, {})[record.entry] = record

    def take_damaged(self, hour: int, entry: int) -> DamagedRecord | None:
        """What was wrong with the record of ``entry`` (held as ``b""``), once."""
        found = self.damaged.get(hour)
        return found.pop(entry, None) if found else None

    def forget(self, hour: int, entries: list[int]) -> None:
        """Drop these entries' records (held back from the lanes), read or being read."""
        reading = self.reading.get(hour)
        if reading:
            reading.difference_update(entries)
        damaged = self.damaged.get(hour)
        if damaged:
            for entry in entries:
                damaged.pop(entry, None)
        cache = self.records.get(hour)
        if not cache:
            return
        size = count = 0
        for entry in entries:
            record = cache.pop(entry, None)
            if record is not None:
                size += len(record)
                count += 1
        self.records_held -= count
        self.bytes_held -= size

    def close_hour(self, hour: int) -> None:
        """Close ``hour``'s readers and drop what is left of its records."""
        for readers in (self.readers, self.fire_readers):
            reader = readers.pop(hour, None)
            if reader is not None:
                reader.close()
        self.damaged.pop(hour, None)
        cache = self.records.pop(hour, None)
        if cache:  # normally empty by now: every entry read ahead was handed out
            self.records_held -= len(cache)
            self.bytes_held -= sum(map(len, cache.values()))

    def close_readers(self) -> None:
        for readers in (self.readers, self.fire_readers):
            for reader in readers.values():
                reader.close()
            readers.clear()


__all__ = ["ReadAhead"]
