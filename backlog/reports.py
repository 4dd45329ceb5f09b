"""The reports as Spark DataFrames, from the tasks' rows; written to Parquet under ``--out``.

Tables (docs/backlog.md lists every column), each partitioned by ``report_time``
(the ``--at`` moment, ``YYYYMMDDTHHMMSSZ``; rerunning a report time replaces it):

- ``scheduled_backlog``: per scheduler group, subject and due hour: messages still to
  deliver, their bytes, how many are overdue at the report time, how many of them are
  still only in the message log (not filed), and how many were already dispatched;
- ``delay_horizon``: per scheduler group and subject, how far ahead producers schedule
  (``deliver_at - created_at``) in buckets;
- ``consumer_backlog``: per realtime group, subject and consumer group: messages not yet
  handed out, given back and waiting, handed out and not acked, the oldest waiting
  one, retries waiting, dead letters;
- ``delivery_lateness``: per subject and hour of ``deliver_at``, how late delayed
  messages reached realtime (its ``stored_at`` minus ``deliver_at``): p50, p99, max;
- ``problems``: each damaged file, where, and what was wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.types import (
    BooleanType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from delaymq.backlog import rows
from delaymq.backlog.formats import DEAD_PREFIX, RETRY_PREFIX, SEPARATOR


def _schema(*fields: tuple[str, Any, bool]) -> StructType:
    return StructType([StructField(name, kind, nullable) for name, kind, nullable in fields])


_S, _L, _T = StringType(), LongType(), TimestampType()

#: The tables' columns as written (``report_time`` is the partition column).
SCHEMAS: dict[str, StructType] = {
    "scheduled_backlog": _schema(
        ("scheduler_group", _S, False), ("subject", _S, False), ("due_hour", _T, False), ("messages", _L, False),
        ("bytes", _L, False), ("overdue", _L, False), ("unfiled", _L, False), ("dispatched", _L, False),
        ("report_time", _S, False),
    ),
    "delay_horizon": _schema(
        ("scheduler_group", _S, False), ("subject", _S, False), ("bucket", IntegerType(), False),
        ("bucket_label", _S, False), ("low_ms", _L, False), ("high_ms", _L, True), ("messages", _L, False),
        ("report_time", _S, False),
    ),
    "consumer_backlog": _schema(
        ("realtime_group", _S, False), ("subject", _S, False), ("consumer_group", _S, False),
        ("broadcast", BooleanType(), False), ("consumers", _L, False), ("stored", _L, False), ("waiting", _L, False),
        ("redelivery_waiting", _L, False), ("handed_out_unacked", _L, False), ("retries_waiting", _L, False),
        ("retries_unacked", _L, False), ("dead_letters", _L, False), ("oldest_waiting_at", _T, True),
        ("oldest_waiting_age_ms", _L, True), ("report_time", _S, False),
    ),
    "delivery_lateness": _schema(
        ("subject", _S, False), ("hour", _T, False), ("messages", _L, False), ("p50_ms", _L, False),
        ("p99_ms", _L, False), ("max_ms", _L, False), ("report_time", _S, False),
    ),
    "problems": _schema(
        ("kind", _S, False), ("group", _S, False), ("file", _S, False), ("offset", _L, False), ("problem", _S, False),
        ("report_time", _S, False),
    ),
}  # fmt: skip

_RAW: dict[str, StructType] = {
    rows.BACKLOG: _schema(("scheduler_group", _S, False), ("subject", _S, False), ("hour", _L, False),
                          ("messages", _L, False), ("bytes", _L, False), ("overdue", _L, False),
                          ("unfiled", _L, False), ("dispatched", _L, False)),
    rows.HORIZON: _schema(("scheduler_group", _S, False), ("subject", _S, False), ("bucket", _L, False),
                          ("messages", _L, False)),
    rows.PROBLEM: _schema(("kind", _S, False), ("group", _S, False), ("file", _S, False), ("offset", _L, False),
                          ("problem", _S, False)),
    rows.STORED: _schema(("realtime_group", _S, False), ("subject", _S, False), ("entries", _L, False)),
    rows.SHARE: _schema(("realtime_group", _S, False), ("subject", _S, False), ("consumer_group", _S, False),
                        ("broadcast_consumer", _S, False), ("waiting", _L, False), ("redelivery_waiting", _L, False),
                        ("oldest_stored_at", _L, True)),
    rows.UNACKED: _schema(("realtime_group", _S, False), ("subject", _S, False), ("consumer_group", _S, False),
                          ("consumer", _S, False), ("broadcast", BooleanType(), False), ("unacked", _L, False),
                          ("unacked_redelivered", _L, False)),
    rows.ENTRY: _schema(("realtime_group", _S, False), ("offset", _L, False), ("stored_at", _L, False)),
    rows.RECORD: _schema(("realtime_group", _S, False), ("offset", _L, False), ("subject", _S, False),
                         ("deliver_at", _L, False)),
}  # fmt: skip


@dataclass
class Reports:
    """The report DataFrames of one run (``report_time`` not yet added)."""

    scheduled_backlog: DataFrame
    delay_horizon: DataFrame
    consumer_backlog: DataFrame
    delivery_lateness: DataFrame
    problems: DataFrame

    def tables(self) -> dict[str, DataFrame]:
        return {name: getattr(self, name) for name in SCHEMAS}

    def cache(self) -> None:
        """Keep the (small, aggregated) reports: they are written, then collected for the charts."""
        for frame in self.tables().values():
            frame.cache()

    def unpersist(self) -> None:
        for frame in self.tables().values():
            frame.unpersist()


#: Every row kind in one table, so the tasks' rows cross into the JVM once and are cached
#: there: a tag, then the row's strings, longs and its one boolean, each in order.
_STRINGS, _LONGS = 4, 6
GENERIC = _schema(
    ("tag", _S, False),
    *[(f"s{i}", _S, True) for i in range(_STRINGS)],
    *[(f"n{i}", _L, True) for i in range(_LONGS)],
    ("flag", BooleanType(), True),
)


def _layout(tag: str) -> list[tuple[str, str]]:
    """``(raw column, generic column)`` of a row kind."""
    out, strings, longs = [], 0, 0
    for column in _RAW[tag].fields:
        if isinstance(column.dataType, StringType):
            out.append((column.name, f"s{strings}"))
            strings += 1
        elif isinstance(column.dataType, BooleanType):
            out.append((column.name, "flag"))
        else:
            out.append((column.name, f"n{longs}"))
            longs += 1
    return out


_LAYOUTS = {tag: _layout(tag) for tag in _RAW}
_KINDS = {tag: [type(column.dataType) for column in _RAW[tag].fields] for tag in _RAW}


def to_generic(row: tuple) -> tuple:
    """A task's tagged row as a ``GENERIC`` row (runs in the executors)."""
    strings: list[str | None] = [None] * _STRINGS
    longs: list[int | None] = [None] * _LONGS
    flag = None
    s = n = 0
    for kind, value in zip(_KINDS[row[0]], row[1:]):
        if kind is StringType:
            strings[s] = value
            s += 1
        elif kind is BooleanType:
            flag = value
        else:
            longs[n] = value
            n += 1
    return (row[0], *strings, *longs, flag)


def _frame(found: DataFrame, tag: str) -> DataFrame:
    raw = _RAW[tag]
    return found.where(F.col("tag") == tag).select(
        *[F.col(generic).cast(raw[name].dataType).alias(name) for name, generic in _LAYOUTS[tag]]
    )


def build(found: DataFrame, *, at_ms: int) -> Reports:
    """The reports from the tasks' rows (``found``: ``GENERIC`` rows, cached)."""
    spark = found.sparkSession
    return Reports(
        scheduled_backlog=_scheduled_backlog(_frame(found, rows.BACKLOG)),
        delay_horizon=_delay_horizon(spark, _frame(found, rows.HORIZON)),
        consumer_backlog=_consumer_backlog(
            _frame(found, rows.SHARE), _frame(found, rows.UNACKED), _frame(found, rows.STORED), at_ms
        ),
        delivery_lateness=_delivery_lateness(_frame(found, rows.ENTRY), _frame(found, rows.RECORD)),
        problems=_frame(found, rows.PROBLEM).dropDuplicates(),
    )


def _scheduled_backlog(raw: DataFrame) -> DataFrame:
    sums = [F.sum(c).cast("long").alias(c) for c in ("messages", "bytes", "overdue", "unfiled", "dispatched")]
    return (
        raw.groupBy("scheduler_group", "subject", "hour")
        .agg(*sums)
        .select(
            "scheduler_group",
            "subject",
            F.timestamp_millis(F.col("hour") * rows.HOUR_MS).alias("due_hour"),
            "messages",
            "bytes",
            "overdue",
            "unfiled",
            "dispatched",
        )
    )


def _delay_horizon(spark: SparkSession, raw: DataFrame) -> DataFrame:
    buckets = spark.createDataFrame(
        [(i, label, *rows.horizon_bounds(i)) for i, label in enumerate(rows.HORIZON_LABELS)],
        _schema(("bucket", _L, False), ("bucket_label", _S, False), ("low_ms", _L, False), ("high_ms", _L, True)),
    )
    return (
        raw.groupBy("scheduler_group", "subject", "bucket")
        .agg(F.sum("messages").cast("long").alias("messages"))
        .join(F.broadcast(buckets), "bucket")
        .select(
            "scheduler_group",
            "subject",
            F.col("bucket").cast("int").alias("bucket"),
            "bucket_label",
            "low_ms",
            "high_ms",
            "messages",
        )  # fmt: skip
    )


def _base_subject(subject: str, group: str) -> Any:
    """A share's subject with its group's retry prefix taken off, and whether it had one."""
    prefix = F.concat(F.lit(RETRY_PREFIX), F.col(group), F.lit(SEPARATOR))
    is_retry = F.col(subject).startswith(prefix)
    base = F.when(is_retry, F.expr(f"substring({subject}, length({group}) + {len(RETRY_PREFIX) + len(SEPARATOR) + 1})"))
    return base.otherwise(F.col(subject)), is_retry


def _consumer_backlog(shares: DataFrame, unacked: DataFrame, stored: DataFrame, at_ms: int) -> DataFrame:
    keys = ["realtime_group", "subject", "consumer_group"]
    base, is_retry = _base_subject("subject", "consumer_group")
    waiting = (
        shares.withColumn("retry", is_retry)
        .withColumn("subject", base)
        .groupBy(*keys)
        .agg(
            F.sum(F.when(~F.col("retry"), F.col("waiting")).otherwise(0)).alias("waiting"),
            F.sum(F.when(~F.col("retry"), F.col("redelivery_waiting")).otherwise(0)).alias("redelivery_waiting"),
            F.sum(F.when(F.col("retry"), F.col("waiting") + F.col("redelivery_waiting")).otherwise(0)).alias("retries_waiting"),
            F.min("oldest_stored_at").alias("oldest_stored_at"),
            F.max(F.col("broadcast_consumer") != "").alias("broadcast_share"),
        )
    )  # fmt: skip
    handed = (
        unacked.withColumn("retry", is_retry)
        .withColumn("subject", base)
        .groupBy(*keys)
        .agg(
            F.sum(F.when(~F.col("retry"), F.col("unacked")).otherwise(0)).alias("handed_out_unacked"),
            F.sum(F.when(F.col("retry"), F.col("unacked")).otherwise(0)).alias("retries_unacked"),
            F.countDistinct(F.when(~F.col("retry"), F.col("consumer"))).alias("consumers"),
            F.max("broadcast").alias("broadcast_consumers"),
        )
    )
    counts = stored.groupBy("realtime_group", "subject").agg(F.sum("entries").alias("stored"))
    dead = counts.select(
        "realtime_group", F.col("subject").alias("dead_subject"), F.col("stored").alias("dead_letters")
    )
    joined = (
        waiting.join(handed, keys, "full_outer")
        .join(counts, ["realtime_group", "subject"], "left")
        .withColumn("dead_subject", F.concat(F.lit(DEAD_PREFIX), F.col("consumer_group"), F.lit(SEPARATOR), F.col("subject")))
        .join(dead, ["realtime_group", "dead_subject"], "left")
    )  # fmt: skip
    zero = F.lit(0).cast("long")
    oldest = F.col("oldest_stored_at")
    return joined.select(
        *keys,
        (F.coalesce(F.col("broadcast_share"), F.lit(False)) | F.coalesce(F.col("broadcast_consumers"), F.lit(False))).alias("broadcast"),
        F.coalesce(F.col("consumers"), zero).cast("long").alias("consumers"),
        *[F.coalesce(F.col(c), zero).cast("long").alias(c) for c in (
            "stored", "waiting", "redelivery_waiting", "handed_out_unacked", "retries_waiting", "retries_unacked",
            "dead_letters")],
        F.timestamp_millis(oldest).alias("oldest_waiting_at"),
        F.when(oldest.isNotNull(), F.greatest(F.lit(at_ms) - oldest, zero)).cast("long").alias("oldest_waiting_age_ms"),
    )  # fmt: skip


def _delivery_lateness(entries: DataFrame, records: DataFrame) -> DataFrame:
    """Exact nearest-rank percentiles: the p-th is the smallest lateness with at least p of the messages at or below it."""
    late = (
        records.join(entries, ["realtime_group", "offset"])
        .select("subject", (F.col("deliver_at") / rows.HOUR_MS).cast("long").alias("hour"),
                (F.col("stored_at") - F.col("deliver_at")).alias("lateness"))
        .groupBy("subject", "hour", "lateness")
        .count()
    )  # fmt: skip
    cell = Window.partitionBy("subject", "hour")
    running = cell.orderBy("lateness").rowsBetween(Window.unboundedPreceding, Window.currentRow)
    ranked = late.withColumn("below", F.sum("count").over(running)).withColumn("total", F.sum("count").over(cell))

    def percentile(p: float) -> Any:
        return F.min(F.when(F.col("below") >= F.ceil(F.col("total") * p), F.col("lateness")))

    return ranked.groupBy("subject", "hour").agg(
        F.first("total").cast("long").alias("messages"),
        percentile(0.5).cast("long").alias("p50_ms"),
        percentile(0.99).cast("long").alias("p99_ms"),
        F.max("lateness").cast("long").alias("max_ms"),
    ).select("subject", F.timestamp_millis(F.col("hour") * rows.HOUR_MS).alias("hour"), "messages", "p50_ms",
             "p99_ms", "max_ms")  # fmt: skip


def write(reports: Reports, out: str, report_time: str) -> dict[str, str]:
    """Write every table under ``out`` (one folder each), replacing this report time's partition."""
    written = {}
    for name, frame in reports.tables().items():
        path = out.rstrip("/") + "/" + name
        # Written straight into this report time's partition folder: rerunning a report
        # time replaces it alone, and a table with no rows still gets a file (its schema).
        frame.coalesce(1).write.mode("overwrite").parquet(f"{path}/report_time={report_time}")
        written[name] = path
    return written


def read_table(spark: SparkSession, out: str, name: str) -> DataFrame:
    """A table as written, with its documented schema (also when a run wrote no rows)."""
    return spark.read.schema(SCHEMAS[name]).parquet(out.rstrip("/") + "/" + name)


__all__ = ["GENERIC", "SCHEMAS", "Reports", "build", "read_table", "to_generic", "write"]
