"""``delaymq bench``: benchmarks that print figures (never pass/fail).

Each suite returns rows of (name, value, unit); this module only prints them.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

Row = tuple[str, float, str]

#: suite name -> (module, function, does it take a scratch directory)
SUITES: dict[str, tuple[str, str, bool]] = {
    "codec": ("delaymq.bench.codec", "bench_codec", False),
    "log": ("delaymq.bench.log", "bench_log_append", True),
    "realtime": ("delaymq.bench.realtime", "bench_realtime", True),
    "delay": ("delaymq.bench.cluster", "bench_delay", True),
    "restart": ("delaymq.bench.restart", "bench_restart", True),
    "failover": ("delaymq.bench.failover", "bench_failover", True),
    "cancel": ("delaymq.bench.cancel", "bench_cancel", True),
    "backlog": ("delaymq.bench.backlog", "bench_backlog", True),
}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="run benchmarks and print their figures",
        description="Run benchmarks and print their figures. 'all' runs every suite.",
    )
    parser.add_argument("suite", choices=["all", *SUITES], nargs="?", default="all")
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="scratch directory for on-disk benchmarks (default: a temporary one)",
    )
    parser.add_argument(
        "--realtime",
        action="store_true",
        help="failover: SIGKILL the master of a replicated realtime group (instead of a scheduler group's)",
    )
    parser.set_defaults(func=run)


def print_rows(title: str, rows: list[Row]) -> None:
    print(f"\n== {title}")
    width = max((len(name) for name, _, _ in rows), default=10)
    for name, value, unit in rows:
        print(f"  {name:<{width}}  {value:>14,.1f} {unit}")


def run(args: argparse.Namespace) -> int:
    if args.realtime and args.suite != "failover":
        print(
            "delaymq bench: --realtime goes with the failover suite: delaymq bench failover --realtime", file=sys.stderr
        )
        return 2
    if args.suite == "all":  # every suite, and the failover of a realtime group too
        runs: list[tuple[str, dict[str, bool]]] = [(name, {}) for name in SUITES] + [("failover", {"realtime": True})]
    else:
        runs = [(args.suite, {"realtime": True} if args.realtime else {})]
    for name, options in runs:
        module_name, function_name, wants_dir = SUITES[name]
        function: Callable[..., list[Row]] = getattr(importlib.import_module(module_name), function_name)
        if wants_dir:
            with tempfile.TemporaryDirectory(dir=args.dir, prefix=f"delaymq-bench-{name}-") as scratch:
                rows = function(Path(scratch), **options)
        else:
            rows = function(**options)
        print_rows(f"{name} --realtime" if options else name, rows)
    return 0
