"""``delaymq send``: send (or schedule) messages and print their ids, one per line."""

from __future__ import annotations

import argparse
import sys
from datetime import datetime

from delaymq.cli import options
from delaymq.cli.connection_options import add_tls_options, client_limits
from delaymq.client.blocking import BlockingProducer
from delaymq.client.producer import DEFAULT_META
from delaymq.client.routes import RouteError
from delaymq.net.connection import TransportError
from delaymq.protocol.errors import ProtocolError

#: Messages per request when ``--count`` asks for many.
CHUNK = 1000


def meta_list(text: str) -> list[str]:
    """``--meta``: one HOST:PORT or several, comma separated."""
    return [options.address(part) for part in text.split(",") if part.strip()] or [options.address(text)]


def when(text: str) -> datetime | int:
    """``--at``: an ISO 8601 moment with a timezone (``Z`` or ``+01:00``), or epoch milliseconds."""
    text = text.strip()
    if text.isdigit():
        return int(text)
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a moment: write ISO 8601 with a timezone, e.g. 2026-12-24T18:00:00Z, "
            "or epoch milliseconds"
        ) from None
    if moment.tzinfo is None:
        raise argparse.ArgumentTypeError(f"{text!r} has no timezone: add Z (UTC) or an offset such as +01:00")
    return moment


def add_meta(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--meta",
        type=meta_list,
        default=DEFAULT_META,
        metavar="HOST:PORT[,...]",
        help="the metaserver(s) to ask for routes (default: %(default)s)",
    )
    add_tls_options(parser, server=False)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "send",
        help="send or schedule messages, printing their ids",
        description=(
            "Send a message (or --count copies, each with its own id) and print each id on its own line. "
            "With --delay or --at it is scheduled for that moment."
        ),
    )
    add_meta(parser)
    parser.add_argument("subject", metavar="SUBJECT")
    parser.add_argument("body", metavar="BODY", help="the message body; '-' reads it from standard input")
    parser.add_argument("--tag", action="append", default=[], metavar="TAG", help="a tag (repeat for several)")
    parser.add_argument("--count", type=int, default=1, metavar="N", help="send N messages (default: 1)")
    parser.add_argument(
        "--key",
        metavar="KEY",
        help="a business key, e.g. order-42: 'delaymq cancel|move|query --subject S --key K' reach every message "
        "sent with it",
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--delay",
        type=options.delay,
        metavar="DURATION",
        help="deliver after this long, e.g. 90s, 2h (a negative one means now)",
    )
    group.add_argument("--at", type=when, metavar="MOMENT", help="deliver at this moment, e.g. 2026-12-24T18:00:00Z")
    parser.add_argument(
        "--timeout", type=options.duration, default="10s", metavar="DURATION", help="per request (default: 10s)"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    meta = args.meta if isinstance(args.meta, list) else meta_list(args.meta)
    if args.count < 1:
        print(f"delaymq send: --count is {args.count}, must be at least 1", file=sys.stderr)
        return 1
    body: bytes = sys.stdin.buffer.read() if args.body == "-" else args.body.encode()
    try:
        with BlockingProducer(meta, timeout=args.timeout, limits=client_limits(args)) as producer:
            delay, at = args.delay, args.at
            if delay is not None and delay < 0:  # "5 s ago": a moment in the past, delivered now
                at = producer.clock.now_ms() + round(delay * 1000)
                delay = None
            left = args.count
            while left:
                n = min(left, CHUNK)
                batch = [
                    producer.message(args.subject, body, tags=args.tag, delay=delay, at=at, key=args.key)
                    for _ in range(n)
                ]
                for message_id in producer.send_batch(batch):
                    print(message_id)
                sys.stdout.flush()
                left -= n
    except (ProtocolError, RouteError, TransportError, ValueError) as error:
        print(f"delaymq send: {error}", file=sys.stderr)
        return 1
    return 0


__all__ = ["add_parser", "run", "when", "meta_list"]
