"""Damaged, missing and empty data: the report says what it could not read, and never crashes."""

from __future__ import annotations

import os
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from delaymq.backlog.plan import REALTIME, SCHEDULER, Source
from delaymq.backlog.rows import UNREADABLE
from delaymq.protocol.records import encode_message
from delaymq.scheduler.hours import hour_name
from delaymq.scheduler.server import SCHEDULER_SEGMENT_SIZE
from delaymq.storage.log import SegmentedLog

HOUR_MS = 3_600_000
pytestmark = pytest.mark.slow


def _hour(moment: datetime) -> int:
    return int(moment.timestamp() * 1000) // HOUR_MS


def _pending_per_hour(rows: list[dict[str, Any]]) -> Counter[int]:
    out: Counter[int] = Counter()
    for r in rows:
        out[_hour(r["due_hour"])] += r["messages"]
    return out


def test_a_truncated_hour_file_is_reported_by_name_and_offset_and_the_rest_is_counted(
    cluster_data: Any, run_job: Any, tmp_path: Path
) -> None:
    root = cluster_data.copy(tmp_path / "data")
    per_hour = Counter(m.deliver_at // HOUR_MS for m in cluster_data.far)
    hour = max(per_hour, key=lambda h: (per_hour[h], -h))  # the busiest far hour
    log = root / "scheduler-1" / "schedule" / f"{hour_name(hour)}.log"
    sizes = [m.size for m in cluster_data.far if m.deliver_at // HOUR_MS == hour]  # in filing (sending) order
    cut = log.stat().st_size // 2
    os.truncate(log, cut)
    result = run_job(cluster_data.sources(root), at_ms=cluster_data.at_ms, html=False)
    problems = result.table("problems")
    assert len(problems) == 1
    problem = problems[0]
    assert problem["file"] == str(log)
    # The first record that no longer fits starts where the intact ones end.
    kept = intact_end = 0
    while kept < len(sizes) and intact_end + sizes[kept] <= cut:
        intact_end += sizes[kept]
        kept += 1
    assert problem["offset"] == intact_end and "ends" in problem["problem"]
    backlog = result.table("scheduled_backlog")
    pending = _pending_per_hour([r for r in backlog if r["subject"] != cluster_data.retry_subject])
    assert pending[hour] == per_hour[hour]  # every committed entry still counted
    assert sum(r["messages"] for r in backlog if r["subject"] == UNREADABLE) == len(sizes) - kept
    others = Counter(m.deliver_at // HOUR_MS for m in cluster_data.far if m.deliver_at // HOUR_MS != hour)
    assert all(pending[h] == n for h, n in others.items())


def test_a_missing_dispatch_log_counts_the_hour_as_not_delivered(
    cluster_data: Any, run_job: Any, tmp_path: Path
) -> None:
    root = cluster_data.copy(tmp_path / "data")
    dispatch_logs = sorted((root / "scheduler-1" / "schedule").glob("*.dispatch"))
    assert dispatch_logs  # the near messages were dispatched
    for path in dispatch_logs:
        path.unlink()
    result = run_job(cluster_data.sources(root), at_ms=cluster_data.at_ms, html=False)
    backlog = result.table("scheduled_backlog")
    assert sum(r["dispatched"] for r in backlog) == 0
    near = sum(cluster_data.near.values())
    assert result.view.pending == len(cluster_data.far) + 1 + near  # the near ones count as to deliver again
    due = sum(1 for m in cluster_data.far if m.deliver_at <= cluster_data.at_ms) + 1 + near
    assert result.view.overdue == due
    assert result.table("problems") == []


def test_records_not_yet_filed_are_counted_from_the_message_log(
    cluster_data: Any, run_job: Any, tmp_path: Path
) -> None:
    root = cluster_data.copy(tmp_path / "data")
    hour = cluster_data.at_ms // HOUR_MS + 30
    records = [
        encode_message(
            f"late-{i}", "invoices", body=b"abc", deliver_at=hour * HOUR_MS + i, created_at=cluster_data.at_ms
        )
        for i in range(7)
    ]
    messages = root / "scheduler-1" / "messages"
    with SegmentedLog.open(messages, segment_size=SCHEDULER_SEGMENT_SIZE) as log:  # as if the server died before filing
        log.append(b"".join(records))
        log.flush()
    result = run_job(cluster_data.sources(root), at_ms=cluster_data.at_ms, html=False)
    rows = [r for r in result.table("scheduled_backlog") if r["subject"] == "invoices"]
    assert [(_hour(r["due_hour"]), r["messages"], r["unfiled"], r["bytes"]) for r in rows] == [
        (hour, 7, 7, sum(len(r) for r in records))
    ]
    assert result.view.unfiled == 7
    horizon = [r for r in result.table("delay_horizon") if r["subject"] == "invoices"]
    assert [(r["bucket_label"], r["messages"]) for r in horizon] == [("1-7 days", 7)]


def test_a_damaged_consume_log_entry_is_reported_and_the_rest_is_read(
    cluster_data: Any, run_job: Any, tmp_path: Path
) -> None:
    root = cluster_data.copy(tmp_path / "data")
    consume = root / "realtime-1" / "consume"
    name = next(p for p in consume.glob("*.name") if p.read_text() == "orders")
    log = name.with_suffix(".log")
    data = bytearray(log.read_bytes())
    data[32 * 5 + 3] ^= 0xFF  # entry 5's offset field
    log.write_bytes(bytes(data))
    result = run_job(cluster_data.sources(root), at_ms=cluster_data.at_ms, html=False)
    problems = result.table("problems")
    assert [(p["file"], p["offset"]) for p in problems] == [(str(log), 32 * 5)]
    assert "CRC" in problems[0]["problem"]
    lateness = Counter()
    for r in result.table("delivery_lateness"):
        lateness[r["subject"]] += r["messages"]
    assert lateness["orders"] == cluster_data.near["orders"] - 1  # the one entry that does not check
    g1 = next(r for r in result.table("consumer_backlog") if r["consumer_group"] == "g1")
    assert g1["waiting"] == cluster_data.near["orders"] - cluster_data.consumed["g1_handed"]


def test_empty_data_folders_give_an_empty_report_with_every_table_and_chart(run_job: Any, tmp_path: Path) -> None:
    (tmp_path / "scheduler-1").mkdir()
    (tmp_path / "realtime-1").mkdir()
    sources = [Source(SCHEDULER, "scheduler-1", str(tmp_path / "scheduler-1")),
               Source(REALTIME, "realtime-1", str(tmp_path / "realtime-1"))]  # fmt: skip
    result = run_job(sources, at_ms=1_765_000_000_000)
    assert (result.view.pending, result.view.overdue, result.view.problem_count) == (0, 0, 0)
    assert result.view.notes and all("holds no" in note for note in result.view.notes)
    for name in ("scheduled_backlog", "delay_horizon", "consumer_backlog", "delivery_lateness", "problems"):
        assert result.table(name) == []
    page = (result.out / "report.html").read_text()
    assert page.count("Plotly.newPlot") == 6 and "no scheduled messages to deliver" in page
