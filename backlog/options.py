"""The backlog job's options, shared by ``delaymq backlog`` and the ``spark-submit`` entry
(``deploy/spark/backlog_job.py``). Imports no Spark: ``delaymq --help`` stays quick."""

from __future__ import annotations

import argparse
from datetime import UTC, datetime


def moment(text: str) -> int:
    """Epoch ms of an ISO-8601 time ("2025-12-24T18:00:00Z"); UTC unless it names an offset."""
    try:
        parsed = datetime.fromisoformat(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an ISO-8601 time such as 2025-12-24T18:00:00Z (UTC unless an offset is given)"
        ) from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return int(parsed.timestamp() * 1000)


def top_count(text: str) -> int:
    if not text.strip().isdigit() or not 1 <= int(text) <= 50:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of subjects from 1 to 50")
    return int(text)


def add_arguments(parser: argparse.ArgumentParser, *, master_default: str | None) -> None:
    parser.add_argument(
        "--scheduler-data",
        nargs="+",
        action="extend",
        default=[],
        metavar="[GROUP=]DIR",
        help="a scheduler's data folder (a path, file://, hdfs://, s3a:// ...); the group is the "
        "folder's name unless given as GROUP=DIR",
    )
    parser.add_argument(
        "--realtime-data",
        nargs="+",
        action="extend",
        default=[],
        metavar="[GROUP=]DIR",
        help="a realtime server's data folder, likewise",
    )
    parser.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="where the Parquet tables and report.html go (a path or a Hadoop-style URI)",
    )
    parser.add_argument(
        "--at",
        type=moment,
        default=None,
        metavar="ISO-TIME",
        help="the moment the report is for: what is overdue then, consumer ages (default: now)",
    )
    parser.add_argument(
        "--master",
        default=master_default,
        metavar="URL",
        help="Spark master (default: %(default)s"
        + (", pyspark's embedded Spark)" if master_default else "; spark-submit's --master)"),
    )
    parser.add_argument(
        "--top", type=top_count, default=8, metavar="N", help="subjects named in the charts (default: %(default)s)"
    )
    parser.add_argument("--no-html", action="store_true", help="write the tables and the summary only")


__all__ = ["add_arguments", "moment"]
