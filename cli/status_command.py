"""``delaymq status``: the metaserver's view of every server, as a table or JSON.

Each scheduler and realtime server the metaserver knows (and has not evicted) is
asked for its own STATUS: every member's role, epoch and replication lag (one
rendering for both kinds), a scheduler's tick, whether it has filed all it received,
its counters since its data folder was created and the pending count of each hour
with messages still to deliver, a realtime server's message and consumer counts.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Mapping
from typing import Any

from delaymq.cli import options
from delaymq.cli.connection_options import add_tls_options, client_limits
from delaymq.client.blocking import BlockingPeers
from delaymq.client.producer import DEFAULT_META
from delaymq.net.connection import TransportError
from delaymq.net.tls import TlsConfigError
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import PeerError, ProtocolError

COLUMNS = ("GROUP", "KIND", "ROLE", "EPOCH", "ADDRESS", "STATE", "LAST HEARTBEAT", "EVICTED", "VERSION")


def add_meta_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--meta",
        type=options.address,
        default=DEFAULT_META,
        metavar="HOST:PORT",
        help="the metaserver to ask (default: %(default)s)",
    )
    parser.add_argument(
        "--timeout",
        type=options.duration,
        default="5s",
        metavar="DURATION",
        help="how long to wait for its answer (default: 5s)",
    )
    add_tls_options(parser, server=False)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "status",
        help="show the server groups the metaserver knows",
        description="Show every server the metaserver knows: its group, role, state and last heartbeat.",
    )
    add_meta_option(parser)
    parser.add_argument("--json", action="store_true", help="print the answer as JSON")
    parser.add_argument(
        "--hours",
        type=_hour_count,
        default=24,
        metavar="N",
        help="list each scheduler's first N hours with messages to deliver (default: %(default)s)",
    )
    parser.set_defaults(func=run)


def _hour_count(text: str) -> int:
    if not text.strip().isdigit() or not 1 <= int(text) <= 20_000:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of hours from 1 to 20000")
    return int(text)


def ask_metaserver(
    command: str, args: argparse.Namespace, code: Command, metadata: dict[str, Any]
) -> dict[str, Any] | None:
    """One request to ``--meta``; on failure print a one-line error and return None."""
    try:
        timeout = options.duration_ms(args.timeout) / 1000
        with BlockingPeers(connect_timeout=timeout, request_timeout=timeout, limits=client_limits(args)) as peers:
            return peers.call(args.meta, code, metadata).metadata
    except PeerError as error:
        print(f"delaymq {command}: metaserver {args.meta} refused: {error}", file=sys.stderr)
    except (TransportError, ProtocolError) as error:
        print(f"delaymq {command}: cannot reach metaserver {args.meta}: {error}", file=sys.stderr)
    except argparse.ArgumentTypeError as error:
        print(f"delaymq {command}: --timeout: {error}", file=sys.stderr)
    except TlsConfigError as error:
        print(f"delaymq {command}: {error}", file=sys.stderr)
    return None


def run(args: argparse.Namespace) -> int:
    answer = ask_metaserver("status", args, Command.STATUS, {})
    if answer is None:
        return 1
    members = ask_members(args, answer.get("rows") or [])
    if args.json:
        shown = {"metaserver": args.meta, **answer, "schedulers": members["scheduler"], "realtime": members["realtime"]}
        print(json.dumps(shown, indent=2, sort_keys=True))
        return 0
    print(format_table(args.meta, answer))
    for row in answer.get("rows") or []:
        key = f"{row['group']} {row['address']}"
        if key in members["scheduler"]:
            print(format_scheduler(row["group"], row["address"], members["scheduler"][key]))
        if key in members["realtime"]:
            print(format_realtime(row["group"], row["address"], members["realtime"][key]))
    return 0


def ask_members(args: argparse.Namespace, rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Each live scheduler's and realtime server's STATUS answer (or ``{"error": ...}``), by kind and
    then keyed "GROUP ADDRESS". A scheduler is asked for its first ``--hours`` hours; a realtime
    server's STATUS takes no fields."""
    answers: dict[str, dict[str, dict[str, Any]]] = {"scheduler": {}, "realtime": {}}
    wanted = [row for row in rows if row.get("kind") in answers and not row.get("evicted")]
    if not wanted:
        return answers
    timeout = options.duration_ms(args.timeout) / 1000
    with BlockingPeers(connect_timeout=timeout, request_timeout=timeout, limits=client_limits(args)) as peers:
        for row in wanted:
            key = f"{row['group']} {row['address']}"
            metadata = {"hours": args.hours} if row["kind"] == "scheduler" else {}
            try:
                answers[row["kind"]][key] = peers.call(row["address"], Command.STATUS, metadata).metadata
            except (TransportError, ProtocolError) as error:
                answers[row["kind"]][key] = {"error": str(error)}
    return answers


def format_member(kind: str, group: str, address: str, answer: dict[str, Any]) -> str:
    """The head of a member's lines, the same for every kind: ``KIND GROUP at ADDRESS: ROLE (epoch N)``.

    A scheduler answers role and epoch at the top of its STATUS, a realtime server in its statistics."""
    stats = answer.get("statistics") or {}
    role = answer.get("role", stats.get("role", "master"))
    epoch = answer.get("epoch", stats.get("epoch", 0))
    master = stats.get("master")
    of = f" of {master}" if role == "slave" and master else ""
    return f"{kind} {group} at {address}: {role} (epoch {epoch}){of}"


def format_scheduler(group: str, address: str, answer: dict[str, Any]) -> str:
    """A scheduler's role, replication, tick and pending hours, for people."""
    if "error" in answer:
        return f"scheduler {group} at {address}: no status ({answer['error']})"
    tick = answer.get("tick") or {}
    stats = answer.get("statistics") or {}
    second = int(tick.get("second", 0))
    clock = f"{second // 3600 % 24:02d}:{second // 60 % 60:02d}:{second % 60:02d}"
    lines = [
        f"{format_member('scheduler', group, address, answer)}, "
        f"tick {tick.get('hour', '?')} {clock} UTC (+{tick.get('done', 0)} done), "
        f"{stats.get('pending', '?')} pending, {stats.get('dispatched', '?')} dispatched, "
        f"lateness max {stats.get('lateness_max_ms', '?')} ms"
    ]
    lines.extend(format_replication(stats.get("replication") or {}))
    lines.extend(format_filing(stats))
    hours = answer.get("hours") or []
    if not hours:
        lines.append("  no messages to deliver")
        return "\n".join(lines)
    lines.append("  HOUR (UTC)  PENDING")
    for hour in hours:
        note = "  overdue" if hour.get("overdue") else ""
        lines.append(f"  {hour['name']}  {hour['pending']:>7}{note}")
    return "\n".join(lines)


def format_filing(stats: dict[str, Any]) -> list[str]:
    """Whether a scheduler has filed everything it received (the message log between the replay
    checkpoint and its end), what its message log holds, and its counters since its data folder
    was created (they survive restarts). Nothing for a scheduler that does not report them."""
    if "unfiled_bytes" not in stats:
        return []
    unfiled, records = stats["unfiled_bytes"], stats.get("unfiled_records", -1)
    held = f"message log holds {stats.get('message_log_bytes', '?')} bytes in {stats.get('message_log_segments', '?')} segment(s)"
    if not unfiled:
        filing = f"  filing done: every record received is filed; {held}"
    else:
        count = "?" if records < 0 else str(records) if stats.get("unfiled_exact") else f"about {records}"
        filing = f"  NOT YET FILED: {count} record(s), {unfiled} bytes; {held}"
    if stats.get("schedule_waits"):
        filing += f"; {stats['schedule_waits']} SCHEDULE(s) waited for filing to catch up since start"
    damage: list[str] = []
    if stats.get("damaged_records") or stats.get("lost_log_bytes"):
        damage = [
            f"  DAMAGE ON DISK since created: {stats.get('damaged_records', 0)} schedule-log record(s) skipped, "
            f"{stats.get('lost_log_bytes', 0)} filed message-log byte(s) lost (no message)"
        ]
    return [
        filing,
        *damage,
        f"  since created: {stats.get('scheduled', '?')} scheduled ({stats.get('rewritten', '?')} due at once), "
        f"{stats.get('filed', '?')} filed, {stats.get('dispatched', '?')} dispatched in "
        f"{stats.get('dispatch_batches', '?')} batches ({stats.get('dispatch_failures', '?')} failed sends), "
        f"{stats.get('deleted_hours', '?')} hours and {stats.get('deleted_segments', '?')} segments deleted",
    ]


def format_realtime(group: str, address: str, answer: dict[str, Any]) -> str:
    """A realtime server's role, replication, message and consumer counts, for people."""
    if "error" in answer:
        return f"realtime {group} at {address}: no status ({answer['error']})"
    stats = answer.get("statistics") or {}
    lines = [
        f"{format_member('realtime', group, address, answer)}, "
        f"{stats.get('messages_stored', '?')} stored, {stats.get('messages_delivered', '?')} handed out, "
        f"{stats.get('acks', '?')} acked, {stats.get('consumers', '?')} consumers, "
        f"message log end {stats.get('message_log_end', '?')}"
    ]
    lines.extend(format_replication(stats.get("replication") or {}))
    fences = answer.get("fences") or {}
    if fences:
        lines.append(
            "  scheduler epochs accepted: " + ", ".join(f"{name} {epoch}" for name, epoch in sorted(fences.items()))
        )
    return "\n".join(lines)


def format_replication(replication: dict[str, Any]) -> list[str]:
    """A member's replication: a master's slaves and their lag, or a slave's lag (and a scheduler
    slave's held tick, a realtime slave's applied offset)."""
    if not replication:
        return []
    lines = [
        f"  replication {replication.get('mode')}, min-insync {replication.get('min_insync')}, "
        f"durable log end {replication.get('durable_end')}"
    ]
    if "in_sync_recorded" in replication:
        recorded = replication["in_sync_recorded"]
        lines.append(f"  in-sync set recorded by the metaserver: {', '.join(recorded) or 'none'}")
    for replica in replication.get("replicas") or []:
        lag_ms = replica.get("lag_ms")
        lines.append(
            f"  slave {replica['address']}: {'in sync' if replica.get('in_sync') else 'OUT OF SYNC'}, "
            f"lag {replica.get('lag_bytes')} bytes / {lag_ms if lag_ms is not None and lag_ms >= 0 else '?'} ms"
        )
    if "lag_bytes" in replication:
        line = f"  behind the master by {replication['lag_bytes']} bytes"
        if "tick_age_ms" in replication:
            age = replication.get("tick_age_ms")
            line += (
                f"; tick held {'never' if age is None else f'{age} ms ago'}, "
                f"{replication.get('tick_behind_ms', '?')} ms behind the master's clock"
            )
        if "applied_offset" in replication:
            line += f"; applied up to offset {replication['applied_offset']}"
        lines.append(line)
    if replication.get("cut_records"):
        lines.append(f"  cut {replication['cut_records']} record(s) the master never had")
    return lines


def slave_sync(rows: Iterable[Mapping[str, Any]]) -> dict[str, tuple[list[str], list[str]]]:
    """Per replicated group (one with an epoch): its slaves in the in-sync set the metaserver
    recorded, and those outside it. A group with one outside it is *under-replicated*: a
    master's death may then only be taken over by the slaves in the set."""
    groups: dict[str, tuple[list[str], list[str]]] = {}
    for row in rows:
        if not row.get("epoch"):
            continue
        in_sync, out = groups.setdefault(row["group"], ([], []))
        if row["role"] == "slave":
            (in_sync if row.get("in_sync") else out).append(row["address"])
    return groups


def format_under_replicated(rows: Iterable[Mapping[str, Any]]) -> list[str]:
    """A line per under-replicated group."""
    lines = []
    for group, (in_sync, out) in sorted(slave_sync(rows).items()):
        if out:
            lines.append(
                f"group {group} is under-replicated: {len(in_sync)} of {len(in_sync) + len(out)} slave(s) in sync "
                f"(not in sync: {', '.join(sorted(out))})"
            )
    return lines


def format_table(meta: str, answer: dict[str, Any]) -> str:
    rows = answer.get("rows") or []
    groups = {row["group"] for row in rows}
    lines = [
        f"metaserver {meta}: {len(groups)} groups, {len(rows)} servers, route version "
        f"{answer.get('route_version')}, evict after {answer.get('evict_after_ms', 0) / 1000:g} s"
    ]
    if not rows:
        lines.append("no server has registered")
        return "\n".join(lines)
    table = [COLUMNS]
    for row in rows:
        role = row["role"] + ("" if row["is_master"] or row["role"] != "master" else " (superseded)")
        table.append(
            (
                row["group"],
                row["kind"],
                role,
                row.get("epoch") or "-",
                row["address"],
                row["state"],
                f"{row['seconds_since_heartbeat']:.1f} s ago",
                "yes" if row["evicted"] else "no",
                row.get("version", ""),
            )
        )
    widths = [max(len(str(line[i])) for line in table) for i in range(len(COLUMNS))]
    for line in table:
        lines.append("  ".join(str(cell).ljust(width) for cell, width in zip(line, widths)).rstrip())
    lines.extend(format_under_replicated(rows))
    return "\n".join(lines)
