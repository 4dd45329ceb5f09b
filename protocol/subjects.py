"""Subject naming rules that servers and clients share: retry and dead-letter subjects.

A consumer group's nacked messages travel on two subjects per group and subject
(``%`` separates the parts, so group names may not hold one):

- ``%retry%<group>%<subject>``: the group's retries. Its consumers pull it
  beside the subject and see the original subject and id; other groups never
  see it.
- ``%dead%<group>%<subject>``: messages that used up their attempts; a subject
  like any other (``delaymq consume '%dead%billing%orders' --group ops``).

The realtime server re-addresses nacked records to these subjects; the
consumer pulls the retry subject and shows the original one. Both check names
with the ``*_problem`` functions here, each raising its own layer's error.
"""

from __future__ import annotations

SEPARATOR = "%"
RETRY_PREFIX = "%retry%"
DEAD_PREFIX = "%dead%"


def group_problem(group: str) -> str | None:
    """Why ``group`` cannot name a consumer group with retries, or None."""
    if SEPARATOR in group:
        return (
            f"group {group!r} holds {SEPARATOR!r}, which separates the parts of the retry and "
            f"dead-letter subjects ({RETRY_PREFIX}<group>%<subject>)"
        )
    return None


def retry_subject(group: str, subject: str) -> str:
    """The subject of ``group``'s retries of ``subject`` (itself if it is one already)."""
    prefix = f"{RETRY_PREFIX}{group}{SEPARATOR}"
    return subject if subject.startswith(prefix) else prefix + subject


def retry_subject_problem(group: str, subject: str, max_subject: int) -> str | None:
    """Why ``group``'s retries of ``subject`` have no subject within ``max_subject`` bytes, or None."""
    target = retry_subject(group, subject)
    size = len(target.encode())
    if size > max_subject:
        return (
            f"subject and group make the retry subject {target!r} of {size} UTF-8 bytes, over max_subject {max_subject}"
        )
    return None


def original_subject(group: str, subject: str) -> str:
    """``subject`` without ``group``'s retry prefix: the subject the message was sent to."""
    prefix = f"{RETRY_PREFIX}{group}{SEPARATOR}"
    return subject[len(prefix) :] if subject.startswith(prefix) else subject


def carrier(subject: str) -> tuple[str, str] | None:
    """``(group, subject it carries)`` of a retry or dead-letter subject; None for other subjects."""
    for prefix in (RETRY_PREFIX, DEAD_PREFIX):
        if subject.startswith(prefix):
            group, sep, base = subject[len(prefix) :].partition(SEPARATOR)
            return (group, base) if sep else None
    return None


def dead_subject(group: str, subject: str) -> str:
    """The dead-letter subject of ``group`` for ``subject`` (or for its retry subject)."""
    return f"{DEAD_PREFIX}{group}{SEPARATOR}{original_subject(group, subject)}"


__all__ = [
    "carrier",
    "DEAD_PREFIX",
    "RETRY_PREFIX",
    "SEPARATOR",
    "dead_subject",
    "group_problem",
    "original_subject",
    "retry_subject",
    "retry_subject_problem",
]
