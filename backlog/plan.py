"""The driver's part: snapshot each data folder's committed state, list its files, plan the tasks.

The driver reads no log: it reads each server's lmdb state once (one read
transaction: what the server last committed, taken beside a running server), lists
file names, and makes one task per hour, consume log, pull log and message-log
segment. Those tasks (``schedule_reader``, ``realtime_reader``) read the files in the
executors, never past what the snapshot counts, so a folder being written gives the
answer of the moment of the snapshot.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from delaymq.backlog import files, rows
from delaymq.backlog.formats import (
    CONSUME,
    CONSUME_FORMAT,
    PULL,
    PULL_FORMAT,
    REALTIME_MESSAGES,
    REALTIME_STATE,
    SCHEDULE,
    SCHEDULE_FORMAT,
    SCHEDULER_MESSAGES,
    SCHEDULER_STATE,
    is_segment_name,
    local_copy,
    open_state,
    realtime_state,
    scheduler_state,
    subject_stem,
)
from delaymq.backlog.realtime_reader import ConsumeLogTask, MessageSegmentTask, PullLogTask, ShareState
from delaymq.backlog.schedule_reader import HourTask, UnfiledTask

SCHEDULER = "scheduler"
REALTIME = "realtime"


class SourceError(ValueError):
    """A data folder the job cannot read at all (missing, not a folder)."""


@dataclass(frozen=True, slots=True)
class Source:
    """A data folder and the group it belongs to."""

    kind: str  # SCHEDULER or REALTIME
    group: str
    location: str


def parse_source(kind: str, text: str) -> Source:
    """``[GROUP=]LOCATION``; without a group, the folder's own name (``scheduler-1``)."""
    group, equals, location = text.partition("=")
    if not equals or "/" in group or ":" in group:
        group, location = "", text
    location = files.normalise(location)
    if not group:
        group = location.rstrip("/").rsplit("/", 1)[-1] or location
    return Source(kind, group, location)


@dataclass
class Plan:
    """What the job reads: tasks, damage found while planning, and what each folder held."""

    tasks: list[Any] = field(default_factory=list)
    problems: list[tuple] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    hours: int = 0  # hour files to read
    scheduled_entries: int = 0  # committed entries over all hours
    realtime_entries: int = 0  # committed consume-log entries

    @property
    def file_count(self) -> int:
        return sum(task.files for task in self.tasks)


def check_sources(sources: list[Source]) -> None:
    """``SourceError`` naming the first folder that is not there (before Spark starts)."""
    for source in sources:
        if not files.list_folder(source.location).exists:
            raise SourceError(f"{source.kind} data folder {source.location} does not exist or is not a folder")


def plan(sources: list[Source], *, at_ms: int) -> Plan:
    check_sources(sources)
    out = Plan()
    for source in sources:
        if source.kind == SCHEDULER:
            _plan_scheduler(source, out, at_ms)
        else:
            _plan_realtime(source, out)
    return out


def _problem(source: Source, where: str, offset: int, text: str) -> tuple:
    return (rows.PROBLEM, source.kind, source.group, where, offset, text)


def _format_problem(location: str, wanted: dict[str, Any]) -> str:
    """Why the FORMAT file of ``location`` does not say ``wanted`` ("" when it does or is absent)."""
    try:
        stored = json.loads(files.read_whole(files.join(location, "FORMAT")))
    except FileNotFoundError:
        return ""
    except ValueError as error:
        return f"FORMAT is not JSON: {error}"
    different = [f"{k} is {stored.get(k)!r}, this job reads {v!r}" for k, v in wanted.items() if stored.get(k) != v]
    return "; ".join(different)


@contextmanager
def _state(location: str) -> Iterator[Any]:
    """The lmdb state of a data folder, read only: in place when local, from a copy otherwise."""
    folder = location
    if files.is_local(folder):
        with open_state(files.local_path(folder)) as state:
            yield state
        return
    try:
        data = files.read_whole(files.join(folder, "data.mdb"))
    except FileNotFoundError:
        yield None
        return
    with local_copy(data) as copy, open_state(Path(copy)) as state:
        yield state


def _segments(location: str) -> list[tuple[int, str, int]]:
    """``(base, name, size)`` of a message log's segments, oldest first."""
    listing = files.list_folder(location)
    return sorted((int(name), name, size) for name, size in listing.sizes.items() if is_segment_name(name))


def _plan_scheduler(source: Source, out: Plan, at_ms: int) -> None:
    schedule = files.join(source.location, SCHEDULE)
    problem = _format_problem(schedule, SCHEDULE_FORMAT)
    if problem:
        out.problems.append(_problem(source, f"{schedule}/FORMAT", 0, f"not read: {problem}"))
        return
    with _state(files.join(source.location, SCHEDULER_STATE)) as state:
        summaries, checkpoint = scheduler_state(state)
    if not summaries and not files.list_folder(schedule).exists:
        out.notes.append(f"scheduler {source.group}: {source.location} holds no schedule yet")
    for hour, (entries, log_end) in sorted(summaries.items()):
        if entries:
            out.tasks.append(HourTask(source.group, source.location, hour, entries, log_end, at_ms))
            out.hours += 1
            out.scheduled_entries += entries
    segments = _segments(files.join(source.location, SCHEDULER_MESSAGES))
    for i, (base, name, size) in enumerate(segments):
        if base + size <= checkpoint:
            continue
        start = max(0, checkpoint - base)
        last = i == len(segments) - 1
        out.tasks.append(UnfiledTask(source.group, source.location, name, base, start, size, last, at_ms))


def _plan_realtime(source: Source, out: Plan) -> None:
    for sub, wanted in ((CONSUME, CONSUME_FORMAT), (PULL, PULL_FORMAT)):
        problem = _format_problem(files.join(source.location, sub), dict(wanted))
        if problem:
            out.problems.append(_problem(source, files.join(source.location, sub, "FORMAT"), 0, f"not read: {problem}"))
            return
    with _state(files.join(source.location, REALTIME_STATE)) as state:
        loaded = realtime_state(state)
    if loaded is None:
        out.notes.append(f"realtime {source.group}: {source.location} holds no checkpoint yet")
        return
    shares: dict[str, list[ShareState]] = {}
    names: dict[str, str] = {}
    for share in loaded.shares.values():
        stem = subject_stem(share.subject)
        names[stem] = share.subject
        shares.setdefault(stem, []).append(
            ShareState(
                share.group,
                share.broadcast_consumer or "",
                share.position,
                tuple(sorted(share.skip)),
                tuple(sequence for sequence, _redeliveries in share.redeliver),
            )
        )
    for stem in sorted(loaded.consume_counts.keys() | shares.keys()):
        count = loaded.consume_counts.get(stem, 0)
        out.tasks.append(ConsumeLogTask(source.group, source.location, stem, names.get(stem, ""), count,
                                        tuple(shares.get(stem, ()))))  # fmt: skip
        out.realtime_entries += count
    for key, record in sorted(loaded.consumers.items()):
        out.tasks.append(
            PullLogTask(
                source.group,
                source.location,
                key.hex(),
                record["subject"],
                record["group"],
                record["consumer"],
                bool(record.get("broadcast")),
                record["acked"],
                record["length"],
                tuple((start, end) for start, end in record["done"]),
            )
        )
    for base, name, size in _segments(files.join(source.location, REALTIME_MESSAGES)):
        stop = min(size, loaded.index_offset - base)
        if stop > 0:
            out.tasks.append(MessageSegmentTask(source.group, source.location, name, base, stop))


__all__ = ["REALTIME", "SCHEDULER", "Plan", "Source", "SourceError", "check_sources", "parse_source", "plan"]
