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
        help="sync: answer after fsync (group commit); async: fsync every 100 ms (default: %(default)s)",
    )
    add_connection_options(parser)


__all__ = ["add_server_options"]
