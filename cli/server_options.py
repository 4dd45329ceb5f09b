"""The options every server command shares: where it listens, registers and keeps data; durations."""

from __future__ import annotations

import argparse
from pathlib import Path

from delaymq.cli import options
from delaymq.cli.connection_options import add_connection_options
from delaymq.client.producer import DEFAULT_META


def add_server_options(parser: argparse.ArgumentParser, *, group: str) -> None:
    """The options every server process shares: where it listens, registers and keeps data."""
    parser.add_argument(
        "--listen",
        type=options.listen_address,
        default="127.0.0.1:0",
        metavar="HOST:PORT",
        help="address to listen on; port 0 picks a free one (default: %(default)s)",
    )
    parser.add_argument(
        "--meta",
        type=options.address,
        action="append",
        metavar="HOST:PORT",
        help=f"metaserver to register with; repeat for several (default: {DEFAULT_META})",
    )
    parser.add_argument("--data", type=Path, metavar="DIR", help="data folder (required; may come from --config)")
    parser.add_argument("--group", default=group, help="server group name (default: %(default)s)")
    parser.add_argument(
        "--flush",
        choices=("sync", "async"),
        default="sync",
        help="sync: answer after fsync (group commit); async: answer once written, fsync every 20 ms (default: %(default)s)",
    )
    add_connection_options(parser)
    add_metrics_option(parser)


def add_metrics_option(parser: argparse.ArgumentParser) -> None:
    """``--metrics-listen``: where the server serves Prometheus metrics (off by default)."""
    parser.add_argument(
        "--metrics-listen",
        type=options.listen_address,
        metavar="HOST:PORT",
        help="serve Prometheus metrics over HTTP at http://HOST:PORT/metrics; port 0 picks a free one (default: off)",
    )


def add_replication_options(parser: argparse.ArgumentParser, *, writes: str) -> None:
    """``--replication`` and ``--min-insync`` of a replicated server group (scheduler, realtime).

    ``writes`` names the requests a master answers only once its in-sync slaves hold them."""
    parser.add_argument(
        "--replication",
        choices=("sync", "async"),
        default="sync",
        help=f"as master: answer {writes} only once --min-insync slaves hold it (sync), or at once (async) "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--min-insync",
        type=_count,
        default=1,
        metavar="N",
        help=f"in-sync slaves that must hold {writes} under sync replication; with fewer in sync it "
        "is refused (retryable) and nothing is stored. 0: none needed (default: %(default)s)",
    )


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be 0 or more")
    return value


__all__ = ["add_metrics_option", "add_replication_options", "add_server_options"]
