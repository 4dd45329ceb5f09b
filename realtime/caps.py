"""Caps on what requests may create on a server: subjects (a SEND) and consumer groups (a PULL).

Every subject is a consume log (two files) and every consumer group of a subject a share
(an lmdb record, kept in memory) with its consumers' pull logs, all for good. A caller
allowed to send or consume could otherwise fill the disk and the memory with names.

- ``SubjectCap``: a producer's SEND whose records would make more than ``max_subjects``
  subjects on the server is refused whole (``limit``, field ``subject``), before anything
  of it is stored. Subjects on their way into the index (appended, not indexed yet) count
  too. A scheduler's SEND (fenced) is never refused by the cap: its messages were accepted
  by the scheduler already (a producer's SCHEDULE, a group's delayed retry) and a refusal
  would stall its dispatch for good. Its subjects past the cap are stored, counted
  (``over``) and logged at most once a minute; descriptors stay bounded all the same
  (``consumelog.OPEN_CONSUME_LOGS``).
- ``GroupCap``: a PULL that would make share number ``max_groups + 1`` (a group reading a
  subject; a broadcast consumer reading it) is refused (``limit``, field ``group``) before
  any file of it is made.

A group's retry and dead-letter subjects (``%retry%G%S``, ``%dead%G%S``) and its shares on
them count against neither cap once group G has a share on S (``carried``): two such
subjects and shares at most per share, so the group cap bounds them, and a group at the
caps keeps its retries and dead letters working. The server's own appends (retries due at
once, dead letters) are never refused.

What exists counts from start-up on (the consume logs and shares a restart opens);
subjects and groups that exist keep working at the cap.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import islice
from typing import Any

from delaymq.clock import Clock
from delaymq.protocol.errors import RemoteProtocolError
from delaymq.protocol.subjects import SEPARATOR, carrier
from delaymq.realtime.checkpoint import share_key
from delaymq.realtime.groups import Share
from delaymq.realtime.index import Indexer

log = logging.getLogger(__name__)

DEFAULT_MAX_SUBJECTS = 10_000
DEFAULT_MAX_GROUPS = 10_000
#: How often a scheduler's SENDs past ``--max-subjects`` are logged at most.
OVER_LOG_INTERVAL_MS = 60_000


def check_cap(name: str, value: int) -> None:
    """Refuse a cap that is not a whole number of at least 1 (``ValueError`` naming it)."""
    if type(value) is not int or value < 1:
        raise ValueError(f"{name} must be a whole number of at least 1, not {value!r}")


def carried(subject: str, shares: Mapping[bytes, Any], group: str | None = None) -> bool:
    """Whether ``subject`` is the retry or dead-letter subject of a group (``group``, if given)
    that reads its base subject (a clustered share on it): such subjects and their shares count
    against no cap. Not when the base is one of that group's own retry or dead-letter subjects:
    a chain of them would be bounded by nothing."""
    if not subject.startswith(SEPARATOR):
        return False
    parts = carrier(subject)
    if parts is None or (group is not None and parts[0] != group):
        return False
    owner, base = parts
    inner = carrier(base)
    if inner is not None and inner[0] == owner:
        return False
    return share_key(base, owner, None) in shares


class _Counted:
    """How many keys of a dict that only grows are carried, scanned as it grows (a new subject
    or share is rare next to requests: the scan runs only when one comes)."""

    def __init__(self, is_carried: Callable[[Any], bool]) -> None:
        self._is_carried = is_carried
        self._scanned = 0
        self._carried = 0

    def count(self, items: Mapping[Any, Any], values: Iterable[Any]) -> int:
        """The items that count (``values``: the dict's keys or values, in insertion order)."""
        size = len(items)
        if size < self._scanned:  # another dict: scan it whole
            self._scanned = self._carried = 0
        if size > self._scanned:
            is_carried = self._is_carried
            self._carried += sum(1 for item in islice(values, self._scanned, None) if is_carried(item))
            self._scanned = size
        return size - self._carried


class SubjectCap:
    """Refuses a producer's SEND that would make more than ``limit`` subjects on this server."""

    def __init__(
        self, limit: int, indexer: Indexer, shares: Mapping[bytes, Share] | None = None, clock: Clock | None = None
    ) -> None:
        check_cap("max_subjects", limit)
        self.limit = limit
        self._indexer = indexer
        self._shares: Mapping[bytes, Share] = shares if shares is not None else {}
        self._clock = clock
        self._coming: set[str] = set()  # admitted by a SEND whose append has not returned yet
        self._logs = _Counted(self._carried)
        #: Subjects a scheduler's SENDs made past the cap (counted as they were admitted).
        self.over = 0
        self._over_logged_at: int | None = None
        self._over_unlogged = 0

    def _carried(self, subject: str) -> bool:
        return carried(subject, self._shares)

    def admit(self, subjects: Sequence[str], *, fenced_by: str | None = None) -> list[str]:
        """The new subjects of a batch that count (none: the hot path, one lookup for a batch of
        one subject), counted until ``settle``; raises ``limit`` if they would pass the cap,
        unless the SEND is a scheduler's (``fenced_by``: its group), which passes."""
        logs = self._indexer.logs
        if not subjects:
            return []
        first = subjects[0]
        if subjects.count(first) == len(subjects):
            if first in logs:
                return []
            new = [first]
        else:
            new = [subject for subject in dict.fromkeys(subjects) if subject not in logs]
        return self._admit_new(new, subjects, fenced_by) if new else new

    def _admit_new(self, new: list[str], subjects: Sequence[str], fenced_by: str | None) -> list[str]:
        new = [subject for subject in new if not self._carried(subject)]
        if not new:
            return new
        coming = {subject for subject in self._indexer.subjects_coming() if not self._carried(subject)}
        on_the_way = coming | self._coming
        fresh = [subject for subject in new if subject not in on_the_way]
        logs = self._indexer.logs
        count = self._logs.count(logs, logs.keys()) + len(on_the_way)
        if count + len(fresh) > self.limit:
            over = fresh[max(0, self.limit - count) :]
            if fenced_by is None:
                raise RemoteProtocolError(
                    f"SEND: subject {over[0]!r} would be subject number {count + fresh.index(over[0]) + 1:,} on "
                    f"this server (--max-subjects {self.limit}); nothing of the batch was stored",
                    code="limit",
                    field="subject",
                    limit=self.limit,
                    index=list(subjects).index(over[0]),
                )
            self._note_over(over, fenced_by, count + len(fresh))
        self._coming.update(fresh)
        return fresh

    def _note_over(self, over: list[str], scheduler_group: str, total: int) -> None:
        """Count a scheduler's subjects past the cap; log them at most once a minute."""
        self.over += len(over)
        self._over_unlogged += len(over)
        now = self._clock.monotonic_ms() if self._clock is not None else 0
        last = self._over_logged_at
        if last is not None and now - last < OVER_LOG_INTERVAL_MS:
            return
        log.warning(
            "realtime: a SEND of scheduler group %r stored subject %r over --max-subjects %d (%d subjects "
            "now; %d made over the cap since the last such line, %d since start): messages a scheduler "
            "accepted are never refused; raise the cap or clean up",
            scheduler_group, over[0], self.limit, total, self._over_unlogged, self.over,
        )  # fmt: skip
        self._over_logged_at = now
        self._over_unlogged = 0

    def settle(self, admitted: list[str]) -> None:
        """The SEND's append returned: its subjects are in the index's hands now (or not stored)."""
        if admitted:
            self._coming.difference_update(admitted)


class GroupCap:
    """Refuses a PULL that would make share number ``limit + 1`` (``shares``: every share of the
    server, a dict that only grows); shares on a group's own retry and dead-letter subjects
    (``carried``) are let through and not counted."""

    def __init__(self, limit: int, shares: Mapping[bytes, Share]) -> None:
        check_cap("max_groups", limit)
        self.limit = limit
        self._shares = shares
        self._counted = _Counted(self._carried)

    def _carried(self, share: Share) -> bool:
        return share.broadcast_consumer is None and carried(share.subject, self._shares, share.group)

    def check(self, subject: str, group: str, broadcast_consumer: str | None) -> None:
        """Raise ``limit`` if a new share of ``group`` (or of its broadcast consumer) reading
        ``subject`` would pass the cap."""
        shares = self._shares
        if len(shares) < self.limit:
            return  # the hot path: no scan while below the cap counting every share
        if broadcast_consumer is None and carried(subject, shares, group):
            return
        count = self._counted.count(shares, shares.values())
        if count < self.limit:
            return
        reader = f"broadcast consumer {broadcast_consumer!r} of group {group!r}" if broadcast_consumer else None
        raise RemoteProtocolError(
            f"PULL: {reader or f'consumer group {group!r}'} reading subject {subject!r} would be group number "
            f"{count + 1:,} on this server (--max-groups {self.limit}; a group counts once per subject it "
            "reads, a broadcast consumer once of its own)",
            code="limit",
            field="group",
            limit=self.limit,
        )


__all__ = [
    "DEFAULT_MAX_GROUPS",
    "DEFAULT_MAX_SUBJECTS",
    "OVER_LOG_INTERVAL_MS",
    "GroupCap",
    "SubjectCap",
    "carried",
    "check_cap",
]
