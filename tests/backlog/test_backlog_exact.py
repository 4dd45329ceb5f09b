"""The report's numbers against what a real cluster run is known to hold, and against ``delaymq status``."""

from __future__ import annotations

from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from delaymq.backlog.reports import SCHEMAS
from delaymq.scheduler.hours import hour_name

HOUR_MS = 3_600_000
pytestmark = pytest.mark.slow


def _hour(moment: datetime) -> int:
    """The hour number of a timestamp Spark handed back (naive, in this process's zone)."""
    return int(moment.timestamp() * 1000) // HOUR_MS


def _by(rows: list[dict[str, Any]], *keys: str) -> dict[tuple, dict[str, Any]]:
    return {tuple(row[k] for k in keys): row for row in rows}


def test_scheduled_backlog_equals_what_was_scheduled_and_what_status_reports(cluster_data: Any, run_job: Any) -> None:
    result = run_job(cluster_data.sources(), at_ms=cluster_data.at_ms)
    backlog = result.table("scheduled_backlog")
    expected: Counter[tuple[str, int]] = Counter()
    expected_bytes: Counter[tuple[str, int]] = Counter()
    for m in cluster_data.far:
        expected[m.subject, m.deliver_at // HOUR_MS] += 1
        expected_bytes[m.subject, m.deliver_at // HOUR_MS] += m.size
    got = {
        (r["subject"], _hour(r["due_hour"])): r
        for r in backlog
        if r["subject"] in ("orders", "reminders", "billing") and r["messages"]
    }
    assert {k: r["messages"] for k, r in got.items()} == dict(expected)
    assert {k: r["bytes"] for k, r in got.items()} == dict(expected_bytes)
    # Near messages were delivered: dispatched, nothing left of them to deliver.
    dispatched = Counter()
    for r in backlog:
        dispatched[r["subject"]] += r["dispatched"]
    assert dict(+dispatched) == dict(cluster_data.near)
    # The nacked retry waits in the scheduler, under the group's retry subject.
    retries = [r for r in backlog if r["subject"] == cluster_data.retry_subject]
    assert sum(r["messages"] for r in retries) == 1
    # Overdue at the report time: due by then and not dispatched.
    due = sum(1 for m in cluster_data.far if m.deliver_at <= cluster_data.at_ms) + 1  # and the retry, due in an hour
    assert sum(r["overdue"] for r in backlog) == due
    assert sum(r["unfiled"] for r in backlog) == 0
    # Per hour, the same pending counts as the scheduler's STATUS (``delaymq status``).
    per_hour = Counter()
    for r in backlog:
        if r["messages"]:
            per_hour[hour_name(_hour(r["due_hour"]))] += r["messages"]
    assert dict(per_hour) == cluster_data.status_hours
    assert result.view.pending == len(cluster_data.far) + 1
    assert result.table("problems") == []
    assert {r["scheduler_group"] for r in backlog} == {"scheduler-1"}


def test_consumer_backlog_and_lateness_equal_what_the_consumers_did(cluster_data: Any, run_job: Any) -> None:
    result = run_job(cluster_data.sources(), at_ms=cluster_data.at_ms, html=False)
    consumers = _by(result.table("consumer_backlog"), "realtime_group", "subject", "consumer_group")
    g1 = consumers["realtime-1", "orders", "g1"]
    known = cluster_data.consumed
    assert g1["stored"] == cluster_data.near["orders"]
    assert g1["waiting"] == cluster_data.near["orders"] - known["g1_handed"]
    assert g1["handed_out_unacked"] == known["g1_unacked"]
    assert g1["dead_letters"] == known["g1_dead"]
    assert g1["redelivery_waiting"] == 0 and g1["retries_waiting"] == 0
    assert g1["consumers"] == 1 and g1["broadcast"] is False
    assert g1["oldest_waiting_age_ms"] > 0 and g1["oldest_waiting_at"] is not None
    g2 = consumers["realtime-1", "reminders", "g2"]
    assert (g2["stored"], g2["waiting"], g2["handed_out_unacked"], g2["dead_letters"]) == (
        cluster_data.near["reminders"],
        0,
        0,
        0,
    )
    assert g2["oldest_waiting_age_ms"] is None
    lateness = result.table("delivery_lateness")
    per_subject = Counter()
    for r in lateness:
        per_subject[r["subject"]] += r["messages"]
        assert 0 <= r["p50_ms"] <= r["p99_ms"] <= r["max_ms"] < 30_000
    assert dict(per_subject) == dict(cluster_data.near)  # dead letters are not deliveries


def test_tables_read_back_with_the_documented_schema(cluster_data: Any, run_job: Any, spark: Any) -> None:
    result = run_job(cluster_data.sources(), at_ms=cluster_data.at_ms, html=False)
    for name, schema in SCHEMAS.items():
        frame = spark.read.parquet(str(result.out / name))  # the schema as stored, not as we pass it
        stored = {field.name: field.dataType for field in frame.schema.fields}
        assert stored == {field.name: field.dataType for field in schema.fields}, name
        assert {row[0] for row in frame.select("report_time").collect()} <= {result.view.report_time}
    partitions = sorted(p.name for p in (result.out / "scheduled_backlog").iterdir() if p.is_dir())
    assert partitions == [f"report_time={result.view.report_time}"]


def test_a_second_report_time_adds_a_partition_and_the_same_one_replaces_it(
    cluster_data: Any, run_job: Any, tmp_path: Path
) -> None:
    out = tmp_path / "reports"
    first = run_job(cluster_data.sources(), at_ms=cluster_data.at_ms, out=out, html=False)
    run_job(cluster_data.sources(), at_ms=cluster_data.at_ms, out=out, html=False)
    run_job(cluster_data.sources(), at_ms=cluster_data.at_ms + HOUR_MS, out=out, html=False)
    rows = first.table("scheduled_backlog")
    assert len({r["report_time"] for r in rows}) == 2
    counts = Counter(r["report_time"] for r in rows)
    assert counts[first.view.report_time] * 2 == sum(counts.values())  # one copy per report time
