"""A scheduler's endpoint shows what its schedule and dispatch logs hold on disk, and
how long filing's and dispatch-log flushes' fsyncs take.

A real cluster on loopback (``metrics_cluster``): a producer schedules messages due in
a moment and two hours ahead; once they are filed and the due ones delivered, the
``delaymq_log_bytes`` gauges read what the scheduler's hour files hold on disk.
"""

from __future__ import annotations

from pathlib import Path

import trio

from delaymq.client import open_producer

from .test_metrics_cluster import metrics_cluster, scrape, scrape_until, value
from .test_metrics_schedule_store import disk_bytes


async def test_scheduler_metrics_show_its_schedule_and_dispatch_logs(tmp_path: Path) -> None:
    due, later = 30, 12
    async with metrics_cluster(tmp_path) as (meta, _meta_metrics, _rt_metrics, sched_metrics):
        with trio.fail_after(30):
            async with open_producer(meta) as producer:
                await producer.send_batch([producer.message("orders", f"due {n}", delay=0.2) for n in range(due)])
                await producer.send_batch(
                    [producer.message("orders", f"later {n}" + "x" * n, delay=7_200) for n in range(later)]
                )
            # Filed, the due ones delivered and recorded in their dispatch log (pending: the later ones).
            await scrape_until(sched_metrics, "delaymq_scheduler_messages_dispatched_total", due)
            await scrape_until(sched_metrics, "delaymq_scheduler_pending_messages", later)
            samples = await scrape_until(sched_metrics, "delaymq_scheduler_unfiled_bytes", 0)
            on_disk = disk_bytes(tmp_path / "sched" / "schedule")
            _, types = await scrape(sched_metrics)

    assert value(samples, "delaymq_scheduler_messages_filed_total") == due + later
    # The hours' schedule logs, indexes and heads tables; the due hour's dispatch log.
    assert value(samples, "delaymq_log_bytes", log="schedule") == on_disk["schedule"] > 0
    assert value(samples, "delaymq_log_bytes", log="dispatch") == on_disk["dispatch"] > 0
    # Each fsync of filing timed; each dispatch-log round flushed (fsynced) at least one log.
    filing = value(samples, "delaymq_scheduler_filing_fsyncs_total")
    assert value(samples, "delaymq_fsync_duration_seconds_count", log="schedule") == filing > 0
    assert value(samples, "delaymq_fsync_duration_seconds_bucket", log="schedule", le="+Inf") == filing
    assert value(samples, "delaymq_fsync_duration_seconds_sum", log="schedule") > 0
    rounds = value(samples, "delaymq_scheduler_confirm_rounds_total")
    assert value(samples, "delaymq_fsync_duration_seconds_count", log="dispatch") >= rounds > 0
    assert types["delaymq_fsync_duration_seconds"] == "histogram"
