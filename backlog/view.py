"""The few numbers people look at, collected from the report DataFrames into plain Python.

The HTML report and the printed summary are built from a ``ReportView``, never from
Spark directly: everything here is already aggregated (top subjects, per hour and
per day), so it stays small however big the backlog.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pyspark.sql import functions as F

from delaymq.backlog import rows
from delaymq.backlog.reports import Reports

OTHER = "(other subjects)"
#: The hourly chart shows this many days from the first hour with messages; the daily one, everything.
HOURLY_DAYS = 60


@dataclass
class ReportView:
    at_ms: int
    report_time: str
    sources: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # totals over every scheduler group
    pending: int = 0
    pending_bytes: int = 0
    overdue: int = 0
    unfiled: int = 0
    dispatched: int = 0
    hours: int = 0  # due hours with messages to deliver
    busiest: list[tuple[datetime, str, int]] = field(default_factory=list)  # (hour, subject, messages)
    # charts: subject -> [(time, messages)], top subjects plus OTHER
    by_hour: dict[str, list[tuple[datetime, int]]] = field(default_factory=dict)
    by_day: dict[str, list[tuple[datetime, int]]] = field(default_factory=dict)
    overdue_by_subject: list[tuple[str, str, int, int]] = field(
        default_factory=list
    )  # group, subject, overdue, unfiled
    horizon: dict[str, list[int]] = field(default_factory=dict)  # subject -> messages per bucket
    consumers: list[dict[str, Any]] = field(default_factory=list)
    lateness: list[dict[str, Any]] = field(default_factory=list)  # per subject and hour, top subjects
    lateness_worst: dict[str, Any] | None = None
    problems: list[dict[str, Any]] = field(default_factory=list)
    problem_count: int = 0
    tables: dict[str, str] = field(default_factory=dict)
    html: str = ""


def utc(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=UTC)


def collect(reports: Reports, *, at_ms: int, report_time: str, top: int) -> ReportView:
    """The view of cached reports, in a handful of small queries (times travel as epoch ms:
    Spark would turn timestamps into this process's local time)."""
    view = ReportView(at_ms=at_ms, report_time=report_time)
    backlog = reports.scheduled_backlog
    columns = ("messages", "bytes", "overdue", "unfiled", "dispatched")
    per_subject = backlog.groupBy("scheduler_group", "subject").agg(*[F.sum(c).alias(c) for c in columns]).collect()
    totals = {c: sum(int(r[c]) for r in per_subject) for c in columns}
    view.pending, view.pending_bytes, view.overdue = totals["messages"], totals["bytes"], totals["overdue"]
    view.unfiled, view.dispatched = totals["unfiled"], totals["dispatched"]
    pending_by_subject: dict[str, int] = {}
    for r in per_subject:
        pending_by_subject[r["subject"]] = pending_by_subject.get(r["subject"], 0) + int(r["messages"])
    leaders = [s for s, m in sorted(pending_by_subject.items(), key=lambda item: (-item[1], item[0])) if m][:top]
    view.overdue_by_subject = sorted(
        ((r["scheduler_group"], r["subject"], int(r["overdue"]), int(r["unfiled"])) for r in per_subject
         if r["overdue"] or r["unfiled"]),
        key=lambda item: (-item[2], -item[3], item[1]),
    )[:30]  # fmt: skip
    label = (
        F.when(F.col("subject").isin(leaders), F.col("subject")).otherwise(F.lit(OTHER)) if leaders else F.lit(OTHER)
    )
    hourly = (
        backlog.where(F.col("messages") > 0)
        .groupBy(label.alias("s"), F.unix_millis("due_hour").alias("t"))
        .agg(F.sum("messages").alias("m"))
        .collect()
    )
    view.hours = len({r["t"] for r in hourly})
    if hourly:
        first = min(r["t"] for r in hourly)
        view.by_hour = _series([(r["s"], r["t"], r["m"]) for r in hourly if r["t"] < first + HOURLY_DAYS * rows.DAY_MS])
        days: dict[tuple[str, int], int] = {}
        for r in hourly:
            key = (r["s"], r["t"] // rows.DAY_MS * rows.DAY_MS)
            days[key] = days.get(key, 0) + int(r["m"])
        view.by_day = _series([(subject, t, m) for (subject, t), m in days.items()])
        named = sorted((r for r in hourly if r["s"] != OTHER), key=lambda r: (-r["m"], r["t"]))
        view.busiest = [(utc(r["t"]), r["s"], int(r["m"])) for r in named[:5]]
    for r in reports.delay_horizon.groupBy(label.alias("s"), "bucket").agg(F.sum("messages").alias("m")).collect():
        view.horizon.setdefault(r["s"], [0] * len(rows.HORIZON_LABELS))[r["bucket"]] += int(r["m"])
    view.consumers = [r.asDict() for r in reports.consumer_backlog.drop("oldest_waiting_at").orderBy(
        F.desc(F.col("waiting") + F.col("handed_out_unacked") + F.col("retries_waiting")), "realtime_group", "subject",
        "consumer_group").limit(200).collect()]  # fmt: skip
    lateness = reports.delivery_lateness.withColumn("hour", F.unix_millis("hour"))
    late_totals = (
        lateness.groupBy("subject").agg(F.sum("messages").alias("m"), F.max("max_ms").alias("worst")).collect()
    )
    late_leaders = [r["subject"] for r in sorted(late_totals, key=lambda r: (-r["m"], r["subject"]))[:4]]
    view.lateness = [
        r.asDict() for r in lateness.where(F.col("subject").isin(late_leaders)).orderBy("subject", "hour").collect()
    ]
    if late_totals:
        worst = max(late_totals, key=lambda r: r["worst"])
        found = (
            lateness.where((F.col("subject") == worst["subject"]) & (F.col("max_ms") == worst["worst"]))
            .limit(1)
            .collect()
        )
        view.lateness_worst = found[0].asDict() if found else None
    problems = reports.problems.orderBy("group", "file").limit(201).collect()
    view.problems = [r.asDict() for r in problems[:200]]
    view.problem_count = reports.problems.count() if len(problems) > 200 else len(problems)
    return view


def _series(found: list[tuple[str, int, int]]) -> dict[str, list[tuple[datetime, int]]]:
    """``(subject, epoch ms, messages)`` as one sorted series per subject, biggest first, OTHER last."""
    series: dict[str, list[tuple[datetime, int]]] = {}
    for subject, t, m in found:
        series.setdefault(subject, []).append((utc(t), int(m)))
    for points in series.values():
        points.sort()
    return dict(sorted(series.items(), key=lambda item: (item[0] == OTHER, -sum(m for _t, m in item[1]))))


__all__ = ["OTHER", "ReportView", "collect", "utc"]
