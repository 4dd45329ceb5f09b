"""``delaymq admin``: change what the metaserver routes (``set-state``) and who masters a
replicated group (``handover``)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from delaymq.cli import options
from delaymq.cli.status_command import add_meta_option, ask_metaserver
from delaymq.protocol.commands import Command
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
        help="administer the metaserver's registry (set-state, handover)",
        description="Administer the metaserver's registry.",
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
