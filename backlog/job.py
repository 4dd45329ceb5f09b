"""The backlog job: plan on the driver, read every file in a Spark task, build, write and show the reports.

``run`` is the job on a given SparkSession; ``main`` is the entry ``spark-submit``
runs (``deploy/spark/backlog_job.py``) and ``delaymq backlog`` calls, with a local
embedded Spark unless ``--master`` says otherwise.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

from pyspark import StorageLevel
from pyspark.sql import SparkSession

from delaymq.backlog import files, html, plan, reports, summary, view
from delaymq.backlog.options import add_arguments
from delaymq.backlog.progress import ProgressLine

log = logging.getLogger("delaymq.backlog")


def report_time(at_ms: int) -> str:
    """The partition value of a report time: ISO 8601 basic format, UTC (``20251224T180000Z``)."""
    return f"{view.utc(at_ms):%Y%m%dT%H%M%SZ}"


def _read(task: Any) -> list[tuple]:
    return task.read()


def open_session(master: str | None) -> tuple[SparkSession, bool]:
    """The active session if there is one (a test's, spark-submit's), else a new one; and
    whether the caller made it (and so stops it)."""
    active = SparkSession.getActiveSession()
    if active is not None:
        return active, False
    builder = (
        SparkSession.builder.appName("delaymq-backlog")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.session.timeZone", "UTC")
    )
    if master is not None:
        builder = builder.master(master)
        if master.startswith("local"):
            # Workers run this very Python (with delaymq installed), not whatever "python3" is on PATH.
            os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
            builder = builder.config("spark.sql.shuffle.partitions", "8").config("spark.ui.enabled", "false")
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark, True


def run(
    spark: SparkSession,
    sources: Sequence[plan.Source],
    *,
    out: str,
    at_ms: int,
    top: int = 8,
    write_html: bool = True,
    stream: TextIO | None = None,
) -> view.ReportView:
    """Read ``sources``, write the tables under ``out`` (and ``out/report.html``); the numbers shown."""
    spark.conf.set("spark.sql.session.timeZone", "UTC")
    context = spark.sparkContext
    started = time.monotonic()
    with ProgressLine(context, stream=stream or sys.stderr) as progress:
        progress.step("reading the servers' committed state and listing files")
        planned = plan.plan(list(sources), at_ms=at_ms)
        what = f"reading {planned.file_count:,} files ({planned.hours:,} hours, {len(planned.tasks):,} tasks)"
        progress.step(what)
        tasks = planned.tasks
        # One Spark task per file task; their rows cross into the JVM once, are spread
        # over a few partitions and cached, so the reports below run without Python.
        read = context.parallelize(tasks, max(1, len(tasks))).flatMap(_read)
        if planned.problems:
            read = read.union(context.parallelize(planned.problems, 1))
        found = (
            spark.createDataFrame(read.map(reports.to_generic), reports.GENERIC)
            .repartition(context.defaultParallelism)
            .persist(StorageLevel.MEMORY_AND_DISK)
        )
        found.count()
        progress.step("building the reports")
        built = reports.build(found, at_ms=at_ms)
        built.cache()
        stamp = report_time(at_ms)
        progress.step("writing the Parquet tables")
        written = reports.write(built, out, stamp)
        progress.step("collecting the figures")
        shown = view.collect(built, at_ms=at_ms, report_time=stamp, top=top)
        built.unpersist()
        found.unpersist()
    shown.sources = [f"{s.kind} {s.group}: {s.location}" for s in sources]
    shown.notes = planned.notes
    shown.tables = written
    if write_html:
        target = files.join(out, "report.html")
        files.write_text(target, html.render(shown))
        shown.html = target
    log.info(
        "backlog: %d tasks, %d entries read in %.1f s",
        len(tasks),
        planned.scheduled_entries,
        time.monotonic() - started,
    )
    return shown


def parse_args(argv: Sequence[str] | None, *, master_default: str | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="backlog_job", description="delaymq backlog reports on Spark")
    add_arguments(parser, master_default=master_default)
    return parser.parse_args(argv)


def execute(args: argparse.Namespace, *, stream: TextIO | None = None) -> int:
    """Run the job for parsed options; print the summary. 2 for a folder that cannot be read."""
    if not args.scheduler_data and not args.realtime_data:
        print("delaymq backlog: give at least one --scheduler-data or --realtime-data folder", file=sys.stderr)
        return 2
    logging.getLogger("py4j").setLevel(logging.WARNING)  # one INFO line per closed connection otherwise
    try:
        sources = [plan.parse_source(plan.SCHEDULER, text) for text in args.scheduler_data]
        sources += [plan.parse_source(plan.REALTIME, text) for text in args.realtime_data]
        plan.check_sources(sources)
        at_ms = args.at if args.at is not None else int(time.time() * 1000)
        spark, owned = open_session(args.master)
        try:
            shown = run(spark, sources, out=files.normalise(args.out), at_ms=at_ms, top=args.top,
                        write_html=not args.no_html)  # fmt: skip
        finally:
            if owned:
                spark.stop()
    except plan.SourceError as error:
        print(f"delaymq backlog: {error}", file=sys.stderr)
        return 2
    print(summary.text(shown), file=stream or sys.stdout, flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """The ``spark-submit`` entry: Spark's master comes from spark-submit unless ``--master`` is given."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)-7s %(name)s: %(message)s")
    return execute(parse_args(argv, master_default=None))


__all__ = ["execute", "main", "open_session", "report_time", "run"]
