"""``delaymq cluster``: the all-in-one local cluster, one process on loopback.

A metaserver, a realtime server and a scheduler, each
with its own folder under ``--data``; the embedded default a new user starts
with (``make run``). Stops cleanly on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
from contextlib import AsyncExitStack
from pathlib import Path

from delaymq.cli import options
from delaymq.cli.serving import run_server, wait_for_stop_signal
from delaymq.client.producer import DEFAULT_META
from delaymq.metaserver.server import open_metaserver
from delaymq.realtime.server import open_realtime_server
from delaymq.scheduler.server import open_scheduler
from delaymq.wheel.clock import SystemClock

log = logging.getLogger("delaymq.cluster")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "cluster",
        help="run a local all-in-one cluster (metaserver, realtime, scheduler) in one process",
        description=(
            "Run a metaserver, a realtime server and a scheduler in one process on loopback, "
            "each with its folder under --data. Producers and consumers use --meta-listen."
        ),
    )
    parser.add_argument("--data", type=Path, default=Path("var/cluster"), metavar="DIR", help="data folder (default: %(default)s)")
    parser.add_argument(
        "--meta-listen",
        type=options.listen_address,
        default=DEFAULT_META,
        metavar="HOST:PORT",
        help="the metaserver's address, the one clients use (default: %(default)s)",
    )
    parser.add_argument(
        "--flush",
        choices=("sync", "async"),
        default="sync",
        help="flush policy of the servers' logs (default: %(default)s)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return run_server(_serve, args, what=f"the local cluster with data {args.data}")


async def _serve(args: argparse.Namespace) -> None:
    data: Path = args.data
    clock = SystemClock()
    async with AsyncExitStack() as stack:
        meta = await stack.enter_async_context(
            open_metaserver(listen=args.meta_listen, data_dir=data / "metaserver", clock=clock)
        )
        realtime = await stack.enter_async_context(
            open_realtime_server(
                data_dir=data / "realtime-1", clock=clock, meta_address=meta.address, flush=args.flush
            )
        )
        scheduler = await stack.enter_async_context(
            open_scheduler(data_dir=data / "scheduler-1", clock=clock, meta_address=meta.address, flush=args.flush)
        )
        print(f"metaserver  {meta.address}", flush=True)
        print(f"realtime    {realtime.address}  (group {realtime.group})", flush=True)
        print(f"scheduler   {scheduler.address}  (group {scheduler.group})", flush=True)
        print(f"data        {data.resolve()}", flush=True)
        print(f"try: delaymq send --meta {meta.address} demo hello", flush=True)
        print("Ctrl-C stops the cluster.", flush=True)
        await wait_for_stop_signal()
