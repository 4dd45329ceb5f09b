"""``delaymq metaserver``: run the metaserver until Ctrl-C or SIGTERM.

It logs the address it bound (``metaserver listening on HOST:PORT``), so a
``--listen`` port of 0 can be used and read back by whoever started it.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from delaymq.cli import options
from delaymq.cli.connection_options import add_connection_options, connection_limits, server_auth, tls_settings
from delaymq.cli.server_options import add_metrics_option
from delaymq.cli.serving import fail, run_server, serve_until_stopped
from delaymq.client.producer import DEFAULT_META
from delaymq.clock import SystemClock
from delaymq.metaserver.registry import HEARTBEATS_PER_FAILOVER
from delaymq.net.limits import Limits

if TYPE_CHECKING:
    from delaymq.cli.metrics import MetricsSource
    from delaymq.metaserver.server import Metaserver

log = logging.getLogger("delaymq.metaserver")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "metaserver",
        help="run the metaserver: registry of server groups, heartbeats, routes",
        description=(
            "Run the metaserver. Servers register and heartbeat with it; clients ask it which "
            "server groups to use. Its registry survives restarts in the --data folder."
        ),
    )
    parser.add_argument(
        "--listen",
        type=options.listen_address,
        default=DEFAULT_META,
        metavar="HOST:PORT",
        help="address to listen on; port 0 picks a free one (default: %(default)s)",
    )
    parser.add_argument(
        "--data", type=Path, metavar="DIR", help="folder for the registry (required; may come from --config)"
    )
    parser.add_argument(
        "--evict-after",
        type=options.duration,
        default="30s",
        metavar="DURATION",
        help="drop a server from routes after this long without a heartbeat (default: 30s)",
    )
    parser.add_argument(
        "--heartbeat-interval",
        type=options.duration,
        default="5s",
        metavar="DURATION",
        help="how often servers are told to heartbeat; below --evict-after (default: 5s)",
    )
    options.add_duration(
        parser,
        "--failover-after",
        "1s",
        "promote a replicated group's best in-sync slave after its master is silent this long (its lease); "
        "its servers heartbeat five times as often",
    )
    add_connection_options(parser)
    add_metrics_option(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.data is None:
        return fail('--data DIR is required (or data = "DIR" in the [metaserver] table of --config)')
    try:
        evict_ms = options.duration_ms(args.evict_after)
        interval_ms = options.duration_ms(args.heartbeat_interval)
        failover_ms = options.duration_ms(args.failover_after)
        token, tokens = server_auth(args, listen=args.listen)
        limits = Limits(
            connections=connection_limits(args), tls=tls_settings(args, server=True), token=token, tokens=tokens
        )
    except argparse.ArgumentTypeError as error:
        return fail(str(error))
    if interval_ms < 1 or evict_ms <= interval_ms:
        return fail(
            f"--heartbeat-interval ({options.show_duration(interval_ms)}) must be at least 1ms and shorter "
            f"than --evict-after ({options.show_duration(evict_ms)})"
        )
    if failover_ms < HEARTBEATS_PER_FAILOVER:
        return fail(
            f"--failover-after ({options.show_duration(failover_ms)}) must be at least "
            f"{HEARTBEATS_PER_FAILOVER}ms: a replicated group's servers heartbeat "
            f"{HEARTBEATS_PER_FAILOVER} times within it"
        )
    what = f"the metaserver on {args.listen} with data {args.data}"
    return run_server(
        _serve, args.listen, args.data, evict_ms, interval_ms, failover_ms, limits, args.metrics_listen, what=what
    )


async def _serve(
    listen: str,
    data: Path,
    evict_ms: int,
    interval_ms: int,
    failover_ms: int,
    limits: Limits,
    metrics_listen: str | None,
) -> None:
    # Imported here, not by ``delaymq`` itself: every command (each server of a cluster too) starts sooner.
    from delaymq.metaserver.server import open_metaserver

    async with open_metaserver(
        limits=limits,
        listen=listen,
        data_dir=data,
        clock=SystemClock(),
        evict_after_ms=evict_ms,
        heartbeat_interval_ms=interval_ms,
        failover_after_ms=failover_ms,
    ) as metaserver:
        log.info(
            "metaserver listening on %s (data %s, evict after %s, heartbeat every %s, failover after %s)",
            metaserver.address,
            data,
            options.show_duration(evict_ms),
            options.show_duration(interval_ms),
            options.show_duration(failover_ms),
        )
        await serve_until_stopped(
            metrics_listen=metrics_listen, metrics=lambda: _metrics(metaserver), tokens=limits.tokens, tls=limits.tls
        )


def _metrics(metaserver: Metaserver) -> MetricsSource:
    from delaymq.cli.metrics import MetaserverSource

    return MetaserverSource(metaserver)
