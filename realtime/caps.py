"""Caps on what requests may create on a server: subjects (a SEND) and consumer groups (a PULL).

Every subject is a consume log (two files) and every consumer group of a subject a share
(an lmdb record, kept in memory) with its consumers' pull logs, all for good. A caller
allowed to send or consume could otherwise fill the disk and the memory with names.

- ``SubjectCap``: a SEND whose records would make more than ``max_subjects`` subjects on
  the server is refused whole (``limit``, field ``subject``), before anything of it is
  stored. Subjects on their way into the index (appended, not indexed yet) count too.
  The server's own appends (retries due at once, dead letters) are not refused: they go
  to the retry and dead-letter subjects of groups, bounded by the group cap.
- ``check_group_cap``: a PULL that would make share number ``max_groups + 1`` (a group
  reading a subject; a broadcast consumer reading it) is refused (``limit``, field
  ``group``) before any file of it is made.

What exists counts from start-up on (the consume logs and shares a restart opens);
subjects and groups that exist keep working at the cap.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from delaymq.protocol.errors import RemoteProtocolError
from delaymq.realtime.index import Indexer

DEFAULT_MAX_SUBJECTS = 10_000
DEFAULT_MAX_GROUPS = 10_000


def check_cap(name: str, value: int) -> None:
    """Refuse a cap that is not a whole number of at least 1 (``ValueError`` naming it)."""
    if type(value) is not int or value < 1:
        raise ValueError(f"{name} must be a whole number of at least 1, not {value!r}")


class SubjectCap:
    """Refuses a SEND that would make more than ``limit`` subjects on this server."""

    def __init__(self, limit: int, indexer: Indexer) -> None:
        check_cap("max_subjects", limit)
        self.limit = limit
        self._indexer = indexer
        self._coming: set[str] = set()  # admitted by a SEND whose append has not returned yet

    def admit(self, subjects: Sequence[str]) -> list[str]:
        """The new subjects of a batch (none: the hot path, one lookup for a batch of one subject),
        counted until ``settle``; raises ``limit`` if they would pass the cap."""
        logs = self._indexer.logs
        if not subjects:
            return []
        first = subjects[0]
        if subjects.count(first) == len(subjects):
            new = [] if first in logs else [first]
        else:
            new = [subject for subject in dict.fromkeys(subjects) if subject not in logs]
        if not new:
            return new
        on_the_way = self._indexer.subjects_coming() | self._coming
        fresh = [subject for subject in new if subject not in on_the_way]
        count = len(logs) + len(on_the_way)
        if count + len(fresh) > self.limit:
            over = fresh[max(0, self.limit - count)]
            raise RemoteProtocolError(
                f"SEND: subject {over!r} would be subject number {count + fresh.index(over) + 1:,} on this "
                f"server (--max-subjects {self.limit}); nothing of the batch was stored",
                code="limit",
                field="subject",
                limit=self.limit,
                index=list(subjects).index(over),
            )
        self._coming.update(fresh)
        return fresh

    def settle(self, admitted: list[str]) -> None:
        """The SEND's append returned: its subjects are in the index's hands now (or not stored)."""
        if admitted:
            self._coming.difference_update(admitted)


def check_group_cap(
    limit: int, shares: Mapping[bytes, Any], subject: str, group: str, broadcast_consumer: str | None
) -> None:
    """Refuse (``limit``) a new share when ``limit`` of them exist already."""
    if len(shares) < limit:
        return
    reader = f"broadcast consumer {broadcast_consumer!r} of group {group!r}" if broadcast_consumer else None
    raise RemoteProtocolError(
        f"PULL: {reader or f'consumer group {group!r}'} reading subject {subject!r} would be group number "
        f"{len(shares) + 1:,} on this server (--max-groups {limit}; a group counts once per subject it reads, "
        "a broadcast consumer once of its own)",
        code="limit",
        field="group",
        limit=limit,
    )


__all__ = ["DEFAULT_MAX_GROUPS", "DEFAULT_MAX_SUBJECTS", "SubjectCap", "check_cap", "check_group_cap"]
