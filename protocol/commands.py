"""Command codes: what a request asks for.

Frames carry the command as a plain u16, so a code this side does not know
still decodes; the transport answers it with a ``bad_request`` error. Codes are
grouped by tens with gaps for later commands; a code is never reused.
"""

from __future__ import annotations

import enum


class Command(enum.IntEnum):
    PING = 1
    AUTH = 2  # the connection's token, sent first by a client that has one (delaymq.net.auth)
    # metaserver: registry, routes, mastership
    REGISTER = 10
    HEARTBEAT = 11
    ROUTE = 12
    SET_STATE = 13
    STATUS = 14
    HANDOVER = 15  # graceful switch of a replicated group's master
    # producers
    SEND = 20  # immediate messages, to a realtime server
    SCHEDULE = 21  # delayed messages, to a scheduler
    CANCEL = 22  # scheduled messages, by ids or subject + key (docs/cancel.md)
    MOVE = 23  # scheduled messages to a new deliver_at, keeping id and body
    QUERY = 24  # where scheduled messages are
    # consumers
    PULL = 30
    ACK = 31
    NACK = 32
    CONSUMER_HEARTBEAT = 33
    # replication: a slave fetches its master's log (delaymq.replication)
    FETCH = 40
    # administration of one server
    CLEAR_FENCE = 50  # a realtime server forgets a scheduler group's fence (admin only)


def command_name(code: int) -> str:
    """The name of a command code, for logs and errors; unknown codes too."""
    try:
        return Command(code).name
    except ValueError:
        return f"UNKNOWN({code})"


__all__ = ["Command", "command_name"]
