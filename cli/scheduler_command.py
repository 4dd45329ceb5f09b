"""``delaymq scheduler``: run a scheduler (delay server) until Ctrl-C or SIGTERM.

It logs the address it bound (``scheduler GROUP listening on HOST:PORT``), registers
with the metaserver given by ``--meta`` and delivers due messages to the realtime
servers the metaserver routes each subject to.
"""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

from delaymq.cli import options
from delaymq.cli.connection_options import connection_limits, server_auth, tls_settings
from delaymq.cli.options import add_duration
from delaymq.cli.server_options import add_replication_options, add_server_options
from delaymq.cli.serving import fail, run_server, serve_until_stopped
from delaymq.client.producer import DEFAULT_META
from delaymq.clock import SystemClock
from delaymq.net.limits import Limits

#: scheduler.dispatcher.MAX_SEND_AHEAD_MS (not imported: the command starts sooner; a test checks they agree)
MAX_SEND_AHEAD_MS = 10_000
#: What a scheduler run by command sends with (``open_scheduler``'s own defaults are 0: each
#: message fired at its millisecond, as the in-process tests expect). Each message goes to
#: realtime 100 ms before its time, in one SEND per subject per 60 ms: the SEND's round trip
#: and the interval come before the moment (38 ms are left for the round trip), and SENDs
#: (with realtime's fsyncs and the pulls they wake) follow the interval rather than the round
#: trip. A consumer fetching ahead releases each message by its own clock, so a longer
#: interval costs no lateness, only the cancel cut-off (a cancel in the last 100 ms is too
#: late); 40 / 100 ms cost the servers about a sixth less CPU than 20 / 50, and 60 / 100
#: about a tenth less again (docs/performance.md, "Sending ahead").
SEND_AHEAD = "100ms"
SEND_INTERVAL = "60ms"
#: scheduler.wheelset.DEFAULT_LOAD_AHEAD_MS, as text (a test checks they agree).
LOAD_AHEAD = "3s"

if TYPE_CHECKING:
    from delaymq.cli.metrics import MetricsSource
    from delaymq.scheduler.server import Scheduler

log = logging.getLogger("delaymq.scheduler")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "scheduler",
        help="run a scheduler: takes delayed messages, fires each at its millisecond",
        description=(
            "Run a scheduler (delay server). It stores delayed messages in a write-ahead log, files "
            "them by hour and hands each to a realtime server at its deliver_at millisecond."
        ),
    )
    add_server_options(parser, group="scheduler-1")
    add_duration(parser, "--horizon", "732d", "how far ahead a message may be scheduled; later ones are refused")
    add_duration(parser, "--retention", "72h", "how long a fully delivered hour's files are kept")
    add_duration(
        parser,
        "--send-interval",
        SEND_INTERVAL,
        "a subject's SENDs to realtime start at least this far apart: what falls due in between goes in one "
        "batch (fewer requests and fsyncs; without --send-ahead a message waits up to this long more)",
    )
    add_duration(
        parser,
        "--send-ahead",
        SEND_AHEAD,
        "fire each message this long before its deliver_at (at most 10s; 0: at it): realtime stores it at once "
        "and hands it out from deliver_at, so the SEND's round trip and the send interval come before the "
        "moment; a message this close to its time can no longer be cancelled",
    )
    add_duration(
        parser,
        "--load-ahead",
        LOAD_AHEAD,
        "read each second's messages from disk this long before they fall due: longer if a second may hold "
        "many hundred thousand messages or the disk may stall (what is not read by then is read, late, when "
        "it falls due); shorter, a message arriving for a second already read costs a little more",
    )
    add_replication_options(parser, writes="each SCHEDULE")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.data is None:
        return fail('--data DIR is required (or data = "DIR" in the [scheduler] table of --config)')
    try:
        horizon_ms = options.duration_ms(args.horizon)
        retention_ms = options.duration_ms(args.retention)
        send_interval_ms = options.duration_ms(args.send_interval)
        send_ahead_ms = options.duration_ms(args.send_ahead)
        load_ahead_ms = options.duration_ms(args.load_ahead)
        if send_ahead_ms > MAX_SEND_AHEAD_MS:
            return fail(f"--send-ahead: {send_ahead_ms} ms is over the limit of {MAX_SEND_AHEAD_MS} ms")
        token, tokens = server_auth(args, listen=args.listen)
        limits = Limits(
            horizon_ms=horizon_ms,
            connections=connection_limits(args),
            tls=tls_settings(args, server=True),
            token=token,
            tokens=tokens,
        )
    except argparse.ArgumentTypeError as error:
        return fail(str(error))
    except ValueError as error:
        return fail(f"--horizon: {error}")
    meta = args.meta or [DEFAULT_META]
    what = f"scheduler {args.group} on {args.listen} with data {args.data}"
    return run_server(
        _serve, args, meta, limits, retention_ms, send_interval_ms, send_ahead_ms, load_ahead_ms, what=what
    )


async def _serve(
    args: argparse.Namespace,
    meta: list[str],
    limits: Limits,
    retention_ms: int,
    send_interval_ms: int,
    send_ahead_ms: int,
    load_ahead_ms: int,
) -> None:
    # Imported here, not by ``delaymq`` itself: every command (each server of a cluster too) starts sooner.
    from delaymq.scheduler.server import SchedulerSettings, open_scheduler

    settings = SchedulerSettings(  # a whole ``SchedulerSettings``: mypy checks each option's name
        data_dir=args.data,
        listen=args.listen,
        group=args.group,
        meta_address=meta,
        flush=args.flush,
        limits=limits,
        retention_ms=retention_ms,
        send_interval_ms=send_interval_ms,
        send_ahead_ms=send_ahead_ms,
        load_ahead_ms=load_ahead_ms,
        replication=args.replication,
        min_insync=args.min_insync,
    )
    async with open_scheduler(settings, clock=SystemClock()) as scheduler:
        log.info(
            "scheduler %s listening on %s (data %s, metaserver %s, horizon %s, replication %s, min-insync %d); "
            "master or slave as the metaserver says",
            args.group,
            scheduler.address,
            args.data,
            ", ".join(meta),
            options.show_duration(limits.horizon_ms),
            args.replication,
            args.min_insync,
        )
        await serve_until_stopped(
            metrics_listen=args.metrics_listen,
            metrics=lambda: _metrics(scheduler),
            tokens=limits.tokens,
            tls=limits.tls,
        )


def _metrics(scheduler: Scheduler) -> MetricsSource:
    from delaymq.cli.metrics import SchedulerSource

    return SchedulerSource(scheduler)
