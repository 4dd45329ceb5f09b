"""``delaymq consume``: print (and ack) the messages of a subject for a consumer group."""

from __future__ import annotations

import argparse
import base64
import json
import sys
from typing import Any

from delaymq.cli import options
from delaymq.cli.connection_options import client_limits
from delaymq.cli.send_command import add_meta, meta_list
from delaymq.client.blocking import BlockingConsumer
from delaymq.client.consumer import ConsumerFailed
from delaymq.client.delivery import ReceivedMessage
from delaymq.client.messages import iso
from delaymq.client.routes import RouteError
from delaymq.net.connection import TransportError
from delaymq.protocol.errors import ProtocolError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "consume",
        help="print and ack the messages of a subject",
        description=(
            "Receive messages of SUBJECT as a member of consumer group --group, print each one and ack it. "
            "Runs until --max messages or --timeout without one (or Ctrl-C)."
        ),
    )
    add_meta(parser)
    parser.add_argument("subject", metavar="SUBJECT")
    parser.add_argument("--group", required=True, help="the consumer group to join")
    parser.add_argument(
        "--tag", action="append", default=[], metavar="TAG", help="only messages with this tag (repeat: any of them)"
    )
    parser.add_argument(
        "--from",
        dest="start",
        choices=("latest", "earliest"),
        default="latest",
        help="where a new group starts reading (default: %(default)s)",
    )
    parser.add_argument("--broadcast", action="store_true", help="receive every message, not a share of the group's")
    parser.add_argument(
        "--max", type=int, default=None, metavar="N", help="stop after N messages (and pull no more than N)"
    )
    parser.add_argument("--timeout", type=options.duration, default=None, metavar="DURATION",
                        help="stop after this long without a message (default: never)")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument(
        "--consumer-id", default=None, metavar="ID", help="this consumer's name (default: host-pid-random)"
    )
    parser.set_defaults(func=run)


def as_json(message: ReceivedMessage) -> str:
    """One line: id, subject, tags, body (text) or body_base64, deliver_at, received_at (epoch ms), attempts."""
    data: dict[str, Any] = {"id": message.id, "subject": message.subject, "tags": list(message.tags)}
    try:
        data["body"] = message.body.decode()
    except UnicodeDecodeError:
        data["body_base64"] = base64.b64encode(message.body).decode()
    data["deliver_at"] = message.deliver_at
    data["received_at"] = message.received_at
    data["attempts"] = message.attempts
    if message.properties:
        data["properties"] = {k: _plain(v) for k, v in message.properties.items()}
    return json.dumps(data, ensure_ascii=False)


def _plain(value: Any) -> Any:
    return base64.b64encode(value).decode() if isinstance(value, bytes) else value


def as_text(message: ReceivedMessage) -> str:
    """One readable line: when it was due, how late it came, id, tags, body."""
    try:
        body = repr(message.body.decode())
    except UnicodeDecodeError:
        body = f"<{len(message.body)} bytes>"
    tags = f" [{', '.join(message.tags)}]" if message.tags else ""
    retry = f" attempt {message.attempts + 1}" if message.attempts else ""
    return (
        f"{iso(message.deliver_at)} (+{max(0, message.lateness_ms)} ms) {message.subject} "
        f"{message.id}{tags}{retry}: {body}"
    )


def run(args: argparse.Namespace) -> int:
    meta = args.meta if isinstance(args.meta, list) else meta_list(args.meta)
    if args.max is not None and args.max < 1:
        print(f"delaymq consume: --max is {args.max}, must be at least 1", file=sys.stderr)
        return 1
    count = 0
    try:
        with BlockingConsumer(
            meta,
            args.subject,
            group=args.group,
            tags=args.tag,
            broadcast=args.broadcast,
            start=args.start,
            consumer_id=args.consumer_id,
            max_messages_held=args.max if args.max is not None else 1000,
            limit=args.max,  # pulls no more than it prints: nothing taken to give back
            pull_batch=min(100, args.max) if args.max is not None else 100,
            limits=client_limits(args),
        ) as consumer:
            for message in consumer.messages(timeout=args.timeout):
                print(as_json(message) if args.json else as_text(message), flush=True)
                consumer.ack(message)
                count += 1
                if args.max is not None and count >= args.max:
                    break
    except (ProtocolError, RouteError, TransportError, ConsumerFailed, ValueError) as error:
        print(f"delaymq consume: {error}", file=sys.stderr)
        return 1
    return 0


__all__ = ["add_parser", "as_json", "as_text", "run"]
