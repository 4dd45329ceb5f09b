"""``delaymq backlog``: the backlog reports, on an embedded local Spark by default.

What is waiting, where and for how long: per subject and due hour (capacity
planning, what is overdue), per consumer group (who falls behind), how far ahead
producers schedule and how late deliveries reach realtime. Parquet tables and an
HTML report under ``--out``; a summary on standard output. The job itself is
``delaymq.backlog.job`` (the same one ``deploy/spark/submit.sh`` runs on a cluster);
Spark is imported only when the command runs.
"""

from __future__ import annotations

import argparse
import sys

from delaymq.backlog.options import add_arguments


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "backlog",
        help="backlog reports from data folders, computed with Spark",
        description=(
            "Read scheduler and realtime data folders (live or copies) with Spark and write the backlog "
            "reports: Parquet tables and report.html under --out, a summary on standard output."
        ),
    )
    add_arguments(parser, master_default="local[*]")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        from delaymq.backlog.job import execute
    except ImportError as error:
        print(f"delaymq backlog: needs the spark extra (pip install 'delaymq[spark]'): {error}", file=sys.stderr)
        return 2
    return execute(args)
