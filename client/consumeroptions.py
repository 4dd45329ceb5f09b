"""The checks of a consumer's options that are not about pulling: names, modes, ``fetch_ahead``.

Each raises ``LocalProtocolError`` naming the option, before anything is sent.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

from delaymq.client.messages import seconds_to_ms
from delaymq.net.limits import Limits
from delaymq.protocol.errors import LocalProtocolError
from delaymq.protocol.fields import PULL_STARTS, check_name
from delaymq.protocol.limits import MAX_NAME, MAX_PULL_AHEAD_MS
from delaymq.protocol.subjects import group_problem, retry_subject, retry_subject_problem

#: How long before their ``deliver_at`` a consumer takes messages a scheduler sent ahead
#: (seconds; it holds them until due): more than a scheduler's default send-ahead and
#: send interval (100 + 60 ms), so a PULL takes a SEND's records as they are stored.
DEFAULT_FETCH_AHEAD = 0.2


def default_consumer_id() -> str:
    """host-pid-random: unique per consumer, readable in server statistics."""
    return f"{socket.gethostname()[:200]}-{os.getpid()}-{os.urandom(4).hex()}"


def fetch_ahead_ms(seconds: float | timedelta) -> int:
    """``fetch_ahead`` (seconds or a timedelta) as the PULL's ``ahead_ms``; refused beyond 0..1 s."""
    ms = seconds_to_ms(seconds, name="fetch_ahead", field="fetch_ahead")
    if not 0 <= ms <= MAX_PULL_AHEAD_MS:
        raise LocalProtocolError(
            f"fetch_ahead is {seconds!r} s; give 0 to {MAX_PULL_AHEAD_MS / 1000:g} s",
            code="limit",
            field="fetch_ahead",
            limit=MAX_PULL_AHEAD_MS,
        )
    return ms


def checked_group(group: str) -> str:
    """``group`` if it is a name a consumer group may have (not one of the reserved subject forms)."""
    checked = check_name(group, "group", MAX_NAME)
    problem = group_problem(group)
    if problem:
        raise LocalProtocolError(problem, code="bad_value", field="group")
    return checked


def checked_broadcast(broadcast: bool) -> bool:
    if type(broadcast) is not bool:
        raise LocalProtocolError(f"broadcast is {broadcast!r}, not a bool", code="bad_value", field="broadcast")
    return broadcast


def checked_start(start: str) -> str:
    if start not in PULL_STARTS:
        raise LocalProtocolError(f"start is {start!r}, must be 'latest' or 'earliest'", code="bad_value", field="start")
    return start


def retry_subject_of(group: str, subject: str, *, broadcast: bool, limits: Limits) -> str | None:
    """The group's retry subject for ``subject``; None when nacks give back at once (broadcast,
    or a subject that is itself a retry subject of the group)."""
    if broadcast or retry_subject(group, subject) == subject:
        return None
    problem = retry_subject_problem(group, subject, limits.max_subject)
    if problem:
        raise LocalProtocolError(
            f"{problem}; use a shorter subject or group",
            code="limit",
            field="subject",
            limit=limits.max_subject,
        )
    return retry_subject(group, subject)


__all__ = [
    "DEFAULT_FETCH_AHEAD",
    "checked_broadcast",
    "checked_group",
    "checked_start",
    "default_consumer_id",
    "fetch_ahead_ms",
    "retry_subject_of",
]
