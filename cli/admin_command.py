"""``delaymq admin``: change what the metaserver routes (``set-state``)."""

from __future__ import annotations

import argparse

from delaymq.cli.status_command import add_meta_option, ask_metaserver
from delaymq.protocol.commands import Command
from delaymq.protocol.routes import GroupState

STATE_HELP = "RW: read-write; R: read-only (consumers only, no new messages); NRW: routed to nobody"


def _state(text: str) -> str:
    state = text.strip().upper()
    if state not in {s.value for s in GroupState}:
        allowed = ", ".join(s.value for s in GroupState)
        raise argparse.ArgumentTypeError(f"{text!r} is not a group state; use one of {allowed}")
    return state


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "admin",
        help="administer the metaserver's registry (set-state)",
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
