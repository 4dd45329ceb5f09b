"""``delaymq admin``: change what the metaserver routes (``set-state``), who masters a
replicated group (``handover``), and make realtime servers forget a scheduler group's
fence (``clear-fence``)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from delaymq.cli import options
from delaymq.cli.connection_options import client_limits
from delaymq.cli.status_command import add_meta_option, ask_metaserver
from delaymq.client.blocking import BlockingPeers
from delaymq.net.connection import TransportError
from delaymq.net.tls import TlsConfigError
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import PeerError, ProtocolError
from delaymq.protocol.routes import GroupState

STATE_HELP = "RW: read-write; R: read-only (consumers only, no new messages); NRW: routed to nobody"
#: How often ``handover`` asks the metaserver whether the target took over.
HANDOVER_POLL_S = 0.1


def _state(text: str) -> str:
    state = text.strip().upper()
    if state not in {s.value for s in GroupState}:
        allowed = ", ".join(s.value for s in GroupState)
        raise argparse.ArgumentTypeError(f"{text!r} is not a group state; use one of {allowed}")
    return state


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "admin",
        help="administer the metaserver's registry (set-state, handover) and fences (clear-fence)",
        description="Administer the metaserver's registry, and the realtime servers' fences.",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    set_state = actions.add_parser(
        "set-state",
        help="set a server group's state: RW, R or NRW",
        description=f"Set a server group's state, kept across restarts. {STATE_HELP}.",
    )
    set_state.add_argument("group", metavar="GROUP", help="the group's name")
    set_state.add_argument("state", type=_state, metavar="STATE", help=STATE_HELP)
    add_meta_option(set_state)
    set_state.set_defaults(func=run_set_state)

    handover = actions.add_parser(
        "handover",
        help="hand a replicated group's mastership to one of its in-sync slaves, gracefully",
        description=(
            "Ask a replicated group's master to hand over: it stops accepting, drains replication to the "
            "target and sends its last tick; then the metaserver promotes the target with a new epoch. "
            "Waits until the target is master."
        ),
    )
    handover.add_argument("group", metavar="GROUP", help="the group's name")
    handover.add_argument(
        "--to",
        type=options.address,
        metavar="ADDRESS",
        help="the slave to promote; it must be live and in sync (default: the in-sync slave furthest ahead)",
    )
    options.add_duration(handover, "--wait", "30s", "how long to wait for the target to become master; 0: do not wait")
    add_meta_option(handover)
    handover.set_defaults(func=run_handover)
    _add_clear_fence(actions)


def _add_clear_fence(actions: argparse._SubParsersAction) -> None:
    clear = actions.add_parser(
        "clear-fence",
        help="make the realtime servers forget a scheduler group's fence (its highest epoch seen)",
        description=(
            "Make realtime servers forget the fence of a scheduler group: the highest epoch of the group "
            "they have seen, below which they refuse its SENDs. For a fence set wrongly (a mistaken or forged "
            "epoch that keeps the group's real master out); the group's next SEND sets it again. Asks the "
            "metaserver for the master of every realtime group and sends each CLEAR_FENCE (its slaves follow "
            "it through replication), printing what each answered; with --realtime, asks that server only. "
            "Needs a token of role admin (--token)."
        ),
    )
    clear.add_argument("group", metavar="GROUP", help="the scheduler group whose fence goes")
    clear.add_argument(
        "--realtime",
        type=options.address,
        metavar="ADDRESS",
        help="ask only this realtime server, without the metaserver (a master; a slave refuses)",
    )
    add_meta_option(clear)
    clear.set_defaults(func=run_clear_fence)


def run_set_state(args: argparse.Namespace) -> int:
    answer = ask_metaserver("admin set-state", args, Command.SET_STATE, {"group": args.group, "state": args.state})
    if answer is None:
        return 1
    previous, state = answer.get("previous"), answer.get("state")
    if previous == state:
        print(f"group {args.group} was already {state}")
    else:
        print(f"group {args.group}: {previous} -> {state}")
    return 0


def run_handover(args: argparse.Namespace) -> int:
    request: dict[str, Any] = {"group": args.group}
    if args.to is not None:
        request["to"] = args.to
    started = time.monotonic()
    answer = ask_metaserver("admin handover", args, Command.HANDOVER, request)
    if answer is None:
        return 1
    group, source, target, epoch = args.group, answer.get("from"), answer.get("to"), answer.get("epoch", 0)
    print(f"group {group}: handover from {source} to {target} asked at epoch {epoch}")
    wait_s = options.duration_ms(args.wait) / 1000
    if wait_s <= 0:
        return 0
    while True:
        status = ask_metaserver("admin handover", args, Command.STATUS, {})
        if status is None:
            return 1
        master = next((row for row in status.get("rows") or [] if row["group"] == group and row["is_master"]), None)
        address, now_epoch = (master["address"], master.get("epoch", 0)) if master else (None, epoch)
        if now_epoch > epoch:
            if address == target:
                print(f"group {group}: {target} is master at epoch {now_epoch} ({time.monotonic() - started:.1f} s)")
                return 0
            print(
                f"delaymq admin handover: group {group}: the master changed otherwise, to {address} at epoch "
                f"{now_epoch}; the handover to {target} was dropped",
                file=sys.stderr,
            )
            return 1
        if time.monotonic() - started >= wait_s:
            print(
                f"delaymq admin handover: group {group}: {target} is not master after "
                f"{options.show_duration(round(wait_s * 1000))} (master {address} at epoch {now_epoch}); the "
                "handover stays asked: the master hands over once it has drained replication to the target",
                file=sys.stderr,
            )
            return 1
        time.sleep(HANDOVER_POLL_S)


def run_clear_fence(args: argparse.Namespace) -> int:
    targets = _realtime_masters(args) if args.realtime is None else [("realtime", args.realtime)]
    if targets is None:
        return 1
    if not targets:
        print(f"delaymq admin clear-fence: metaserver {args.meta} knows no realtime master", file=sys.stderr)
        return 1
    failed = 0
    try:
        timeout = options.duration_ms(args.timeout) / 1000
        with BlockingPeers(connect_timeout=timeout, request_timeout=timeout, limits=client_limits(args)) as peers:
            for group, address in targets:
                where = f"realtime {group} at {address}"
                try:
                    answer = peers.call(address, Command.CLEAR_FENCE, {"group": args.group}).metadata
                except PeerError as error:
                    print(f"delaymq admin clear-fence: {where} refused: {error}", file=sys.stderr)
                    failed += 1
                    continue
                except (TransportError, ProtocolError) as error:
                    print(f"delaymq admin clear-fence: cannot reach {where}: {error}", file=sys.stderr)
                    failed += 1
                    continue
                before = answer.get("cleared")
                if before is None:
                    print(f"{where}: held no fence of scheduler group {args.group}")
                else:
                    print(f"{where}: fence of scheduler group {args.group} cleared (it was at epoch {before})")
    except (argparse.ArgumentTypeError, TlsConfigError) as error:
        print(f"delaymq admin clear-fence: {error}", file=sys.stderr)
        return 1
    return 1 if failed else 0


def _realtime_masters(args: argparse.Namespace) -> list[tuple[str, str]] | None:
    """(group, address) of the master of every realtime group the metaserver knows (None: it failed)."""
    status = ask_metaserver("admin clear-fence", args, Command.STATUS, {})
    if status is None:
        return None
    return [
        (row["group"], row["address"])
        for row in status.get("rows") or []
        if row.get("kind") == "realtime" and row.get("is_master") and not row.get("evicted")
    ]
