"""The backlog tests' shared pieces: one local SparkSession, and one real cluster run.

``spark``: a real local SparkSession (``local[2]``, two shuffle partitions, no UI),
made once for the whole test session (starting Spark takes seconds).

``cluster_data``: a real ``delaymq cluster`` child process on loopback schedules a
known set of messages over 24 future hours and three subjects plus some due at
once, delivers those, lets consumer groups take part of them (ack, nack to the dead
letters, nack for a retry in an hour, one left unacked), records what
``delaymq status`` says, and stops cleanly. Tests copy its data folder before
damaging anything.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio

from delaymq.backlog import files
from delaymq.backlog.job import run
from delaymq.backlog.plan import REALTIME, SCHEDULER, Source
from delaymq.backlog.reports import read_table
from delaymq.backlog.view import ReportView
from delaymq.bench.cluster import local_cluster
from delaymq.cli.main import main as delaymq_main
from delaymq.client import open_producer
from delaymq.client.blocking import BlockingPeers
from delaymq.protocol.commands import Command

from ..support.polling import poll_until

HOUR_MS = 3_600_000
SUBJECTS = ("orders", "reminders", "billing")


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    session = (
        SparkSession.builder.master("local[2]")
        .appName("delaymq-backlog-tests")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.default.parallelism", "2")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@dataclass
class Scheduled:
    subject: str
    deliver_at: int
    size: int


@dataclass
class ClusterData:
    root: Path  # holds scheduler-1/ and realtime-1/
    at_ms: int  # the report time the tests use
    far: list[Scheduled]  # not yet due when the cluster stopped
    near: Counter[str]  # delivered to realtime, per subject
    retry_subject: str
    status_hours: dict[str, int]  # delaymq status: pending per hour name
    consumed: dict[str, Any] = field(default_factory=dict)

    def copy(self, to: Path) -> Path:
        shutil.copytree(self.root, to, symlinks=True)
        return to

    def sources(self, root: Path | None = None) -> list[Source]:
        base = root or self.root
        return [
            Source(SCHEDULER, "scheduler-1", str(base / "scheduler-1")),
            Source(REALTIME, "realtime-1", str(base / "realtime-1")),
        ]


async def _schedule(meta: str, far_hour: int) -> tuple[list[Scheduled], Counter[str]]:
    far: list[Scheduled] = []
    near: Counter[str] = Counter()
    async with open_producer(meta) as producer:
        messages = []
        for h in range(24):
            for s, subject in enumerate(SUBJECTS):
                for i in range((h * 7 + s * 3) % 5 + s):
                    at = (far_hour + h) * HOUR_MS + 1_000 + i * 60_000 + s * 7
                    message = producer.message(subject, b"x" * (10 + i), id=f"{subject}-{h}-{i}", at=at)
                    messages.append(message)
                    far.append(Scheduled(subject, at, len(message.encode())))
        now = producer.clock.now_ms()
        for subject, count in (("orders", 20), ("reminders", 10)):
            for i in range(count):
                messages.append(producer.message(subject, b"soon", id=f"{subject}-near-{i}", at=now + 1_500))
                near[subject] += 1
        await producer.send_batch(messages)
    return far, near


def _status(meta: str) -> dict[str, Any]:
    out = io.StringIO()
    with redirect_stdout(out):
        assert delaymq_main(["status", "--meta", meta, "--json", "--hours", "1000"]) == 0
    answer: dict[str, Any] = json.loads(out.getvalue())
    return answer


@pytest.fixture(scope="session")
def cluster_data(tmp_path_factory: pytest.TempPathFactory) -> ClusterData:
    root = tmp_path_factory.mktemp("cluster")
    far_hour = int(time.time() * 1000) // HOUR_MS + 1  # the next hour boundary on
    with local_cluster(root, flush="sync") as cluster:
        far, near = trio.run(_schedule, cluster.meta, far_hour)

        def delivered() -> dict[str, Any] | None:
            answer = _status(cluster.meta)
            scheduler = next(iter(answer["schedulers"].values()))
            return answer if scheduler["statistics"]["dispatched"] >= sum(near.values()) else None

        answer = poll_until(delivered, timeout=60, interval=0.1, what="the near messages to reach realtime")
        realtime = next(row["address"] for row in answer["rows"] if row["kind"] == "realtime")
        with BlockingPeers(request_timeout=30) as peers:
            base = {"group": "g1", "consumer": "c1", "subject": "orders"}
            pulled = peers.call(
                realtime, Command.PULL, {**base, "max": 6, "timeout_ms": 5_000, "from": "earliest"}
            ).metadata
            assert pulled["count"] == 6
            start = pulled["pull_start"]
            peers.call(realtime, Command.ACK, {**base, "start": start, "end": start + 3})
            peers.call(realtime, Command.NACK, {**base, "start": start + 3, "end": start + 4, "dead": True})
            peers.call(realtime, Command.NACK, {**base, "start": start + 4, "end": start + 5, "delay_ms": HOUR_MS})
            base2 = {"group": "g2", "consumer": "c9", "subject": "reminders"}
            pulled2 = peers.call(
                realtime, Command.PULL, {**base2, "max": 100, "timeout_ms": 5_000, "from": "earliest"}
            ).metadata
            assert pulled2["count"] == near["reminders"]
            peers.call(
                realtime,
                Command.ACK,
                {**base2, "start": pulled2["pull_start"], "end": pulled2["pull_start"] + pulled2["count"]},
            )
        filed = sum(near.values()) + len(far) + 1  # the retry comes back through the scheduler

        def settled() -> dict[str, Any] | None:
            answer = _status(cluster.meta)
            scheduler = next(iter(answer["schedulers"].values()))
            return answer if scheduler["statistics"]["filed"] >= filed else None

        answer = poll_until(settled, timeout=60, interval=0.1, what="the retry to be filed")
        scheduler = next(iter(answer["schedulers"].values()))
        status_hours = {hour["name"]: hour["pending"] for hour in scheduler["hours"]}
    at_ms = (far_hour + 4) * HOUR_MS + 30 * 60_000
    return ClusterData(root, at_ms, far, near, "%retry%g1%orders", status_hours,
                       {"g1_handed": 6, "g1_acked": 3, "g1_dead": 1, "g1_retry": 1, "g1_unacked": 1})  # fmt: skip


@dataclass
class JobRun:
    view: ReportView
    out: Path
    spark: Any

    def table(self, name: str) -> list[dict[str, Any]]:
        return [row.asDict() for row in read_table(self.spark, str(self.out), name).collect()]


@pytest.fixture
def run_job(spark: Any, tmp_path: Path) -> Any:
    def runner(sources: list[Source], *, at_ms: int, out: Path | None = None, html: bool = True) -> JobRun:
        target = out or tmp_path / "out"
        shown = run(
            spark, sources, out=files.normalise(str(target)), at_ms=at_ms, write_html=html, stream=io.StringIO()
        )
        return JobRun(shown, target, spark)

    return runner
