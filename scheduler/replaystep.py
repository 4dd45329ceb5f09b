"""A replay step's records: what it files into each hour until its commit (``StagedHour``),
and what it did once committed (``ReplayStep``, with the entries it filed per hour,
``HourArrivals``, for the wheel).

``StagedStep`` (``delaymq.scheduler.staging``) fills the ``StagedHour``s and makes the
``ReplayStep``; ``schedulefiles`` writes the staged hours; ``replay`` and the scheduler's
sessions read the outcome.
"""

from __future__ import annotations

import struct
from array import array
from dataclasses import dataclass, field

from delaymq.scheduler.delayindex import ENTRY_SIZE, HourSummary
from delaymq.scheduler.hours import HOUR_MS, ScheduleError, hour_name

_ENTRY_PLACE = struct.Struct(">QI")  # a staged index entry's offset and size in the hour's log


@dataclass(frozen=True, slots=True)
class HourArrivals:
    """The entries one replay step filed into one hour: numbers ``first_entry`` onwards,
    one per ``ms_in_hour`` value, in entry order."""

    hour: int
    first_entry: int
    ms_in_hour: array[int]

    def __len__(self) -> int:
        return len(self.ms_in_hour)

    def pairs(self) -> list[tuple[int, int]]:
        """``(ms_in_hour, entry_no)`` of each new entry, what ``SecondWheel.link`` takes."""
        return list(zip(self.ms_in_hour, range(self.first_entry, self.first_entry + len(self.ms_in_hour))))


@dataclass(frozen=True, slots=True)
class ReplayStep:
    """What one committed replay step did.

    ``arrivals`` holds, per hour, the entries filed (tell the wheel: ``link`` into a
    loaded second, ``note_arrival`` otherwise; add the hour to the ``HourWheel``).
    ``new_hours`` are the hours that held no entry before.
    """

    start_offset: int  # message-log offset the step started at
    checkpoint: int  # message-log offset the next step starts at (saved)
    filed: int  # records filed into schedule logs
    already_filed: int  # records skipped: filed before a crash, not re-filed
    skipped: int  # records of another kind than MESSAGE
    bytes: int  # message-log bytes the step read
    arrivals: dict[int, HourArrivals] = field(default_factory=dict)
    new_hours: tuple[int, ...] = ()
    #: Entries the step's CANCEL and MOVE records cancelled (hour -> entry numbers),
    #: put in lmdb ``scheduler.cancelled`` in the step's commit so the wheel skips them.
    cancelled: dict[int, list[int]] = field(default_factory=dict)

    @property
    def idle(self) -> bool:
        """Nothing was read: replay is caught up with what the message log holds durably.
        (A step can file nothing yet move on, skipping records filed before a crash.)"""
        return self.checkpoint == self.start_offset


class StagedHour:
    """What the current replay step filed into one hour, until ``commit`` writes it."""

    __slots__ = (
        "hour",
        "base_ms",
        "key_base",
        "committed_entries",
        "committed_log_end",
        "first_source",
        "entries",
        "log_end",
        "last_source",
        "parts",
        "run_view",
        "run_start",
        "run_end",
        "index",
        "ms",
    )

    def __init__(self, hour: int, summary: HourSummary) -> None:
        self.hour = hour
        self.base_ms = hour * HOUR_MS  # epoch ms of the hour's start
        self.key_base = hour << 12  # heads-cache key of second s: key_base | s
        self.committed_entries = self.entries = summary.entries
        self.committed_log_end = self.log_end = summary.log_end
        self.first_source = summary.first_source
        self.last_source = summary.last_source
        self.parts: list[memoryview] = []  # record bytes, slices of the chunks read
        self.run_view: memoryview | None = None  # the run of adjacent records being grown
        self.run_start = 0
        self.run_end = 0
        self.index = bytearray()  # packed index entries
        self.ms = array("I")  # ms_in_hour of each new entry

    def end_run(self) -> None:
        if self.run_view is not None:
            self.parts.append(self.run_view[self.run_start : self.run_end])
            self.run_view = None

    def record(self, entry: int) -> bytes:
        """The record of staged entry ``entry`` (at least ``committed_entries``)."""
        offset, size = _ENTRY_PLACE.unpack_from(self.index, ENTRY_SIZE * (entry - self.committed_entries))
        parts = list(self.parts)
        if self.run_view is not None:
            parts.append(self.run_view[self.run_start : self.run_end])
        at = self.committed_log_end  # the parts hold the hour's new log bytes end to end
        for part in parts:
            if offset < at + len(part):
                return bytes(part[offset - at : offset - at + size])
            at += len(part)
        raise ScheduleError(f"hour {hour_name(self.hour)}: staged entry {entry} is not among the staged records")


__all__ = ["HourArrivals", "ReplayStep", "StagedHour"]
