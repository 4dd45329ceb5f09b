"""``delaymq realtime``: run a realtime server until Ctrl-C or SIGTERM.

It logs the address it bound (``realtime server GROUP listening on HOST:PORT``)
and registers with the metaserver given by ``--meta``, which makes it the master of
its group or a slave of the master there is (a second ``delaymq realtime --group G``
on another data folder joins G as a slave).
"""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

from delaymq.cli import options
from delaymq.cli.connection_options import connection_limits, server_auth, tls_settings
from delaymq.cli.options import add_duration
from delaymq.cli.server_options import add_realtime_caps, add_replication_options, add_server_options, cap_value
from delaymq.cli.serving import fail, run_server, serve_until_stopped
from delaymq.client.producer import DEFAULT_META
from delaymq.clock import SystemClock
from delaymq.net.limits import Limits

if TYPE_CHECKING:
    from delaymq.cli.metrics import MetricsSource
    from delaymq.realtime.server import RealtimeServer

log = logging.getLogger("delaymq.realtime")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "realtime",
        help="run a realtime server: message, consume and pull logs; hands messages to consumers",
        description=(
            "Run a realtime server. It stores immediate messages (from producers and schedulers), "
            "indexes them per subject and hands them to consumer groups."
        ),
    )
    add_server_options(parser, group="realtime-1")
    add_duration(parser, "--dedup-window", "10m", "a message id seen again within this window is stored once")
    add_duration(parser, "--ack-timeout", "60s", "a message pulled and not acked within this goes back to its group")
    add_duration(parser, "--consumer-timeout", "30s", "a consumer silent this long loses what it holds to its group")
    add_realtime_caps(parser)
    add_replication_options(parser, writes="a SEND, PULL or ACK")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.data is None:
        return fail('--data DIR is required (or data = "DIR" in the [realtime] table of --config)')
    try:
        settings = {
            "dedup_window_ms": options.duration_ms(args.dedup_window),
            "ack_timeout_ms": options.duration_ms(args.ack_timeout),
            "consumer_timeout_ms": options.duration_ms(args.consumer_timeout),
            "max_subjects": cap_value(args.max_subjects, "--max-subjects"),
            "max_groups": cap_value(args.max_groups, "--max-groups"),
        }
        token, tokens = server_auth(args, listen=args.listen)
        limits = Limits(
            connections=connection_limits(args), tls=tls_settings(args, server=True), token=token, tokens=tokens
        )
    except argparse.ArgumentTypeError as error:
        return fail(str(error))
    meta = args.meta or [DEFAULT_META]
    what = f"realtime server {args.group} on {args.listen} with data {args.data}"
    return run_server(_serve, args, meta, settings, limits, what=what)


async def _serve(args: argparse.Namespace, meta: list[str], settings: dict[str, int], limits: Limits) -> None:
    # Imported here, not by ``delaymq`` itself: every command (each server of a cluster too) starts sooner.
    from delaymq.realtime.server import open_realtime_server

    async with open_realtime_server(
        data_dir=args.data,
        clock=SystemClock(),
        listen=args.listen,
        group=args.group,
        meta_address=meta,
        flush=args.flush,
        limits=limits,
        dedup_window_ms=settings["dedup_window_ms"],
        ack_timeout_ms=settings["ack_timeout_ms"],
        consumer_timeout_ms=settings["consumer_timeout_ms"],
        replication=args.replication,
        min_insync=args.min_insync,
        max_subjects=settings["max_subjects"],
        max_groups=settings["max_groups"],
    ) as server:
        log.info(
            "realtime server %s listening on %s (data %s, metaserver %s, replication %s, min-insync %d); "
            "master or slave as the metaserver says",
            args.group,
            server.address,
            args.data,
            ", ".join(meta),
            args.replication,
            args.min_insync,
        )
        await serve_until_stopped(
            metrics_listen=args.metrics_listen, metrics=lambda: _metrics(server), tokens=limits.tokens, tls=limits.tls
        )


def _metrics(server: RealtimeServer) -> MetricsSource:
    from delaymq.cli.metrics import RealtimeSource

    return RealtimeSource(server)
