"""Reading folders while their servers write them; the HTML report; the command line; the pyarrow path."""

from __future__ import annotations

import io
import threading
import time
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest
import trio

from delaymq.backlog.html import CHARTS
from delaymq.backlog.plan import REALTIME, SCHEDULER, Source
from delaymq.bench.cluster import local_cluster
from delaymq.cli.main import main as delaymq_main
from delaymq.client import open_producer

HOUR_MS = 3_600_000
pytestmark = pytest.mark.slow


class Sender:
    """Schedules batches of far-future messages until told to stop; counts what was acknowledged."""

    def __init__(self, meta: str) -> None:
        self.meta = meta
        self.acked = 0
        self.stop = threading.Event()
        self.going = threading.Event()
        self.error: BaseException | None = None

    async def _send(self) -> None:
        async with open_producer(self.meta) as producer:
            n = 0
            while not self.stop.is_set():
                now = producer.clock.now_ms()
                batch = [
                    producer.message(f"live-{i % 3}", b"y" * 50, at=now + (2 + n % 40) * HOUR_MS) for i in range(200)
                ]
                await producer.send_batch(batch)
                self.acked += len(batch)
                n += 1
                if self.acked >= 2_000:
                    self.going.set()

    def run(self) -> None:
        try:
            trio.run(self._send)
        except BaseException as error:  # reported by the test
            self.error = error
        finally:
            self.going.set()


def test_a_folder_being_written_gives_a_consistent_answer(run_job: Any, tmp_path: Path) -> None:
    with local_cluster(tmp_path / "live", flush="sync") as cluster:
        sender = Sender(cluster.meta)
        thread = threading.Thread(target=sender.run)
        thread.start()
        try:
            assert sender.going.wait(60)
            before = sender.acked
            sources = [Source(SCHEDULER, "scheduler-1", str(tmp_path / "live" / "scheduler-1")),
                       Source(REALTIME, "realtime-1", str(tmp_path / "live" / "realtime-1"))]  # fmt: skip
            result = run_job(sources, at_ms=int(time.time() * 1000), html=False)
            after = sender.acked
        finally:
            sender.stop.set()
            thread.join(60)
        assert sender.error is None
    assert before <= result.view.pending <= after + 200  # a batch being answered may already be on disk
    assert result.table("problems") == []
    backlog = result.table("scheduled_backlog")
    assert sum(r["messages"] for r in backlog) == result.view.pending
    assert {r["subject"] for r in backlog} <= {"live-0", "live-1", "live-2"}
    assert result.view.overdue == 0


def test_the_command_writes_the_html_report_with_every_chart(cluster_data: Any, tmp_path: Path, spark: Any) -> None:
    out = tmp_path / "report"
    at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(cluster_data.at_ms / 1000))
    printed = io.StringIO()
    with redirect_stdout(printed):
        code = delaymq_main(["backlog", "--scheduler-data", str(cluster_data.root / "scheduler-1"),
                             "--realtime-data", f"rt-a={cluster_data.root / 'realtime-1'}", "--out", str(out),
                             "--at", at])  # fmt: skip
    assert code == 0
    summary = printed.getvalue()
    assert f"scheduled: {len(cluster_data.far) + 1:,} messages to deliver" in summary
    assert "rt-a orders / g1" in summary and "damaged files: none" in summary
    page = (out / "report.html").read_text()
    for element, title in CHARTS:
        assert f'id="{element}"' in page and title in page
    assert page.count("Plotly.newPlot") == len(CHARTS)
    assert "<script src=" not in page  # self-contained: plotly's JavaScript is inlined
    assert "orders" in page and "reminders" in page and "billing" in page
    assert (out / "scheduled_backlog").is_dir()


def test_a_missing_folder_is_refused_before_spark_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = delaymq_main(["backlog", "--scheduler-data", str(tmp_path / "nope"), "--out", str(tmp_path / "out")])
    assert code == 2
    assert f"scheduler data folder {tmp_path / 'nope'} does not exist" in capsys.readouterr().err


def test_the_remote_file_path_reads_the_same_numbers(cluster_data: Any, run_job: Any) -> None:
    """``arrow+file://`` reads through pyarrow's file systems, as hdfs:// and s3a:// folders are read."""
    sources = [Source(SCHEDULER, "scheduler-1", f"arrow+file://{cluster_data.root / 'scheduler-1'}"),
               Source(REALTIME, "realtime-1", f"arrow+file://{cluster_data.root / 'realtime-1'}")]  # fmt: skip
    remote = run_job(sources, at_ms=cluster_data.at_ms, html=False)
    assert remote.view.pending == len(cluster_data.far) + 1
    assert remote.table("problems") == []
    g1 = next(r for r in remote.table("consumer_backlog") if r["consumer_group"] == "g1")
    assert g1["handed_out_unacked"] == cluster_data.consumed["g1_unacked"]
