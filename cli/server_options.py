"""The options every server command shares: where it listens, registers and keeps data; durations."""

from __future__ import annotations

import argparse
from pathlib import Path

from delaymq.cli import options
from delaymq.cli.connection_options import add_connection_options
from delaymq.client.producer import DEFAULT_META

#: The caps of ``delaymq.realtime.caps`` (not imported: every command would load the server).
DEFAULT_MAX_SUBJECTS = 10_000
DEFAULT_MAX_GROUPS = 10_000


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
        help=f"as master: answer {writes} only once every slave of the group's in-sync set holds it (sync), "
        "or at once (async); a slave that falls behind leaves the set within seconds (default: %(default)s)",
    )
    parser.add_argument(
        "--min-insync",
        type=_count,
        default=0,
        metavar="N",
        help=f"the floor of the in-sync set under sync replication: with fewer than N slaves in sync, {writes} "
        "is refused (retryable) and nothing is stored. 0: a member alone serves, and a group of two keeps "
        "serving through either member's death (default: %(default)s)",
    )


def add_realtime_caps(parser: argparse.ArgumentParser) -> None:
    """``--max-subjects`` and ``--max-groups``: what requests may create on a realtime server."""
    parser.add_argument(
        "--max-subjects",
        type=_cap,
        default=DEFAULT_MAX_SUBJECTS,
        metavar="N",
        help="subjects this server holds at most (each is a consume log); a SEND that would make more is "
        "refused whole (code limit), and subjects it has keep working (default: %(default)s)",
    )
    parser.add_argument(
        "--max-groups",
        type=_cap,
        default=DEFAULT_MAX_GROUPS,
        metavar="N",
        help="consumer groups this server holds at most, a group counted once per subject it reads (a broadcast "
        "consumer once of its own); a PULL that would make more is refused (code limit) (default: %(default)s)",
    )


def cap_value(value: object, option: str) -> int:
    """A cap from the command line (checked already) or a config file (an int, unchecked)."""
    try:
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise argparse.ArgumentTypeError(f"{value!r} is not a whole number")
        return _cap(str(value))
    except argparse.ArgumentTypeError as error:
        raise argparse.ArgumentTypeError(f"{option}: {error}") from None


def _cap(text: str) -> int:
    value = _count(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be 1 or more")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be 0 or more")
    return value


__all__ = [
    "DEFAULT_MAX_GROUPS",
    "DEFAULT_MAX_SUBJECTS",
    "add_metrics_option",
    "add_realtime_caps",
    "add_replication_options",
    "add_server_options",
    "cap_value",
]
