"""``delaymq cancel``, ``delaymq move`` and ``delaymq query``: act on scheduled messages.

Each names messages by id (arguments, or ``-`` for one id per line on standard input)
or by ``--subject`` and ``--key`` (every message sent with that business key), asks
the scheduler groups (``--group`` one of them only) and prints one line per id: the
id, its state, then what is known (``deliver_at``, ``dispatched_at``, ``group``...);
``--json`` prints each as a JSON object instead. The exit status is 0 once every
group has answered, whatever the states; 1 when the request could not be made.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from delaymq.cli import options
from delaymq.cli.connection_options import client_limits
from delaymq.cli.send_command import add_meta, meta_list, when
from delaymq.client.blocking import BlockingProducer
from delaymq.client.messages import iso
from delaymq.client.routes import RouteError
from delaymq.client.scheduled import MessageState
from delaymq.net.connection import TransportError
from delaymq.protocol.errors import ProtocolError

_STATES = {
    "cancel": "cancelled (it will not be delivered), delivered (too late) or unknown (no scheduler group holds it)",
    "move": "moved (deliver_at is the new time), delivered (too late) or unknown",
    "query": "scheduled, delivered, cancelled or unknown",
}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    cancel = subparsers.add_parser(
        "cancel",
        help="cancel scheduled messages by id, or by subject and key",
        description=f"Cancel scheduled messages, so they are never delivered. Each id's line says {_STATES['cancel']}.",
    )
    _add_selection(cancel)
    cancel.set_defaults(func=_runner("cancel"))

    move = subparsers.add_parser(
        "move",
        help="deliver scheduled messages at another time",
        description="Move scheduled messages to another delivery time; they keep their id and body. "
        f"Each id's line says {_STATES['move']}.",
    )
    _add_selection(move)
    when_group = move.add_mutually_exclusive_group(required=True)
    when_group.add_argument(
        "--delay", type=options.delay, metavar="DURATION", help="deliver this long from now, e.g. 90s, 2h, 3d"
    )
    when_group.add_argument(
        "--at", type=when, metavar="MOMENT", help="deliver at this moment, e.g. 2026-12-24T18:00:00Z"
    )
    move.set_defaults(func=_runner("move"))

    query = subparsers.add_parser(
        "query",
        help="show where scheduled messages are",
        description=f"Show where scheduled messages are. Each id's line says {_STATES['query']}, with the due "
        "time, the hour and scheduler group holding it, or when and to which realtime group it was delivered "
        "and, while that group remembers it, what each consumer group did with it "
        "(consumer_groups=GROUP:acked|handed-out|waiting,...).",
    )
    _add_selection(query)
    query.set_defaults(func=_runner("query"))


def _add_selection(parser: argparse.ArgumentParser) -> None:
    add_meta(parser)
    parser.add_argument(
        "ids",
        nargs="*",
        metavar="ID",
        help="message ids (as 'delaymq send' prints them); '-' reads them from standard input",
    )
    parser.add_argument("--subject", metavar="SUBJECT", help="with --key: every message of SUBJECT sent with KEY")
    parser.add_argument("--key", metavar="KEY", help="the business key the messages were sent with (send --key)")
    parser.add_argument(
        "--group", metavar="GROUP", help="ask only this scheduler group (default: every scheduler group)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object per id")
    parser.add_argument(
        "--timeout", type=options.duration, default="10s", metavar="DURATION", help="per request (default: 10s)"
    )


def as_text(state: MessageState) -> str:
    """One line: id, state, then each known field as name=value (times in ISO 8601 UTC)."""
    parts = [state.id, state.state]
    if state.deliver_at is not None:
        parts.append(f"deliver_at={iso(state.deliver_at)}")
    if state.dispatched_at is not None:
        parts.append(f"dispatched_at={iso(state.dispatched_at)}")
    if state.hour is not None:
        parts.append(f"hour={iso(state.hour * 3_600_000)[:13]}")
    if state.group is not None:
        parts.append(f"group={state.group}")
    if state.realtime_group is not None:
        parts.append(f"realtime_group={state.realtime_group}")
    if state.consumer_groups:  # "handed out" as handed-out: one word per field
        groups = ",".join(f"{name}:{where.replace(' ', '-')}" for name, where in state.consumer_groups.items())
        parts.append(f"consumer_groups={groups}")
    return " ".join(parts)


def _runner(command: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        return _run(command, args)

    return run


def _ids(args: argparse.Namespace) -> list[str] | None:
    if args.ids == ["-"]:
        return [line.strip() for line in sys.stdin if line.strip()]
    return args.ids or None


def _run(command: str, args: argparse.Namespace) -> int:
    meta = args.meta if isinstance(args.meta, list) else meta_list(args.meta)
    try:
        ids = _ids(args)
        with BlockingProducer(meta, timeout=args.timeout, limits=client_limits(args)) as producer:
            selection = {"subject": args.subject, "key": args.key, "group": args.group}
            if command == "cancel":
                states = producer.cancel(ids, **selection)
            elif command == "query":
                states = producer.query(ids, **selection)
            else:
                delay, at = args.delay, args.at
                if delay is not None and delay < 0:  # "5 s ago": a moment in the past, delivered now
                    at, delay = producer.clock.now_ms() + round(delay * 1000), None
                states = producer.move(ids, delay=delay, at=at, **selection)
    except (ProtocolError, RouteError, TransportError, ValueError) as error:
        print(f"delaymq {command}: {error}", file=sys.stderr)
        return 1
    for state in states:
        print(json.dumps(state.as_dict(), ensure_ascii=False) if args.json else as_text(state))
    return 0


__all__ = ["add_parser", "as_text"]
