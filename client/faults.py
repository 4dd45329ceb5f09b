"""Broker avoidance: the latency fault table (RocketMQ's ``LatencyFaultToleranceImpl``).

A client that keeps sending to a slow or broken server group makes every send
slow, so each answer's latency (or a failure) decides how long that group is left
out of the rotation. The table is sans-IO: every call is handed the time in epoch
milliseconds and nothing here reads a clock.

The latest observation of a group wins, as in RocketMQ: a fast answer from an
avoided group (tried because nothing else was left) puts it straight back.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class AvoidancePolicy:
    """How long a latency or a failure keeps a group out of the rotation.

    A latency of at least ``latency_steps_ms[i]`` (and below the next step) avoids
    the group for ``avoid_ms[i]``; below the first step it is not avoided. The
    defaults are RocketMQ's ``latencyMax``/``notAvailableDuration`` table without
    its zero-duration steps. A failure (error, timeout, refused connection) counts
    as the longest latency: ``failure_avoid_ms``.
    """

    latency_steps_ms: tuple[int, ...] = (550, 1_000, 2_000, 3_000, 15_000)
    avoid_ms: tuple[int, ...] = (30_000, 60_000, 120_000, 180_000, 600_000)
    failure_avoid_ms: int = 600_000

    def __post_init__(self) -> None:
        steps = tuple(self.latency_steps_ms)
        avoid = tuple(self.avoid_ms)
        object.__setattr__(self, "latency_steps_ms", steps)
        object.__setattr__(self, "avoid_ms", avoid)
        if len(steps) != len(avoid):
            raise ValueError(
                f"avoid_ms has {len(avoid)} entries; it must have one per latency step "
                f"(latency_steps_ms has {len(steps)})"
            )
        for name, values in (("latency_steps_ms", steps), ("avoid_ms", avoid)):
            for value in values:
                if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                    raise ValueError(f"{name} entry {value!r} must be an int >= 0")
        for lower, upper in zip(steps, steps[1:]):
            if upper <= lower:
                raise ValueError(f"latency_steps_ms must be strictly increasing: {upper} follows {lower}")
        for lower, upper in zip(avoid, avoid[1:]):
            if upper < lower:
                raise ValueError(f"avoid_ms must not decrease as latency grows: {upper} follows {lower}")
        failure = self.failure_avoid_ms
        if not isinstance(failure, int) or isinstance(failure, bool) or failure < 0:
            raise ValueError(f"failure_avoid_ms {failure!r} must be an int >= 0")

    def avoid_for_latency(self, latency_ms: int) -> int:
        """Milliseconds a group that answered in ``latency_ms`` is avoided (0: not at all)."""
        step = bisect.bisect_right(self.latency_steps_ms, latency_ms)
        return self.avoid_ms[step - 1] if step else 0


@dataclass(frozen=True, slots=True)
class GroupFault:
    """What the table knows of one group."""

    group: str
    last_latency_ms: int | None  # None: the last observation was a failure or a bare success
    available_from_ms: int
    last_failure_ms: int | None  # None: never failed (since the last forget)
    consecutive_failures: int


@dataclass(frozen=True, slots=True)
class FaultTableStatistics:
    entries: tuple[GroupFault, ...] = field(default_factory=tuple)
    latencies_recorded: int = 0
    failures_recorded: int = 0
    successes_recorded: int = 0


@dataclass(slots=True)
class _Entry:
    last_latency_ms: int | None = None
    available_from_ms: int = 0
    last_failure_ms: int | None = None
    consecutive_failures: int = 0


def _check_group(group: str) -> None:
    if not isinstance(group, str) or not group:
        raise ValueError(f"group {group!r} must be a non-empty str")


class LatencyFaultTable:
    """Per group: until when it is avoided, and when it last failed."""

    def __init__(self, policy: AvoidancePolicy | None = None) -> None:
        self.policy = policy if policy is not None else AvoidancePolicy()
        self._entries: dict[str, _Entry] = {}
        self._latencies = 0
        self._failures = 0
        self._successes = 0

    def record_latency(self, group: str, latency_ms: int, now_ms: int) -> int:
        """Record an answer that took ``latency_ms``; returns the epoch ms it is avoided until."""
        _check_group(group)
        if latency_ms < 0:
            raise ValueError(f"latency_ms {latency_ms} must be >= 0")
        entry = self._entries.setdefault(group, _Entry())
        entry.last_latency_ms = latency_ms
        entry.available_from_ms = now_ms + self.policy.avoid_for_latency(latency_ms)
        entry.consecutive_failures = 0
        self._latencies += 1
        return entry.available_from_ms

    def record_failure(self, group: str, now_ms: int) -> int:
        """Record an error, timeout or refused connection; returns the epoch ms it is avoided until."""
        _check_group(group)
        entry = self._entries.setdefault(group, _Entry())
        entry.last_latency_ms = None
        entry.available_from_ms = now_ms + self.policy.failure_avoid_ms
        entry.last_failure_ms = now_ms
        entry.consecutive_failures += 1
        self._failures += 1
        return entry.available_from_ms

    def record_success(self, group: str, now_ms: int) -> None:
        """Record an answer whose latency was not measured: the group is available again."""
        _check_group(group)
        entry = self._entries.setdefault(group, _Entry())
        entry.last_latency_ms = None
        entry.available_from_ms = now_ms
        entry.consecutive_failures = 0
        self._successes += 1

    def is_available(self, group: str, now_ms: int) -> bool:
        return self.available_from(group) <= now_ms

    def available_from(self, group: str) -> int:
        """Epoch ms from which ``group`` may be picked again; 0 for a group with no record."""
        entry = self._entries.get(group)
        return entry.available_from_ms if entry is not None else 0

    def last_failure(self, group: str) -> int | None:
        entry = self._entries.get(group)
        return entry.last_failure_ms if entry is not None else None

    def forget(self, group: str) -> None:
        """Drop everything known of ``group`` (it left the routes)."""
        self._entries.pop(group, None)

    def retain(self, groups: Iterable[str]) -> None:
        """Forget every group not in ``groups`` (for a table shared by several routes)."""
        keep = set(groups)
        for group in [g for g in self._entries if g not in keep]:
            del self._entries[group]

    def least_recently_failed(self, groups: Iterable[str]) -> str | None:
        """Of ``groups``, the one whose last failure is oldest (never failed counts as oldest).

        Ties go to the earlier group in ``groups``; None when ``groups`` is empty.
        """
        return min(groups, key=self._failure_key, default=None)

    def soonest_available(self, groups: Iterable[str]) -> str | None:
        """Of ``groups``, the one available soonest, then the least recently failed.

        The fallback when every group is avoided: better to try the best of a bad lot
        than to fail the send outright. Ties go to the earlier group in ``groups``.
        """
        return min(groups, key=lambda g: (self.available_from(g), self._failure_key(g)), default=None)

    def _failure_key(self, group: str) -> int:
        last = self.last_failure(group)
        return -1 if last is None else last

    def __contains__(self, group: object) -> bool:
        return group in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def statistics(self) -> FaultTableStatistics:
        return FaultTableStatistics(
            entries=tuple(
                GroupFault(
                    group=group,
                    last_latency_ms=e.last_latency_ms,
                    available_from_ms=e.available_from_ms,
                    last_failure_ms=e.last_failure_ms,
                    consecutive_failures=e.consecutive_failures,
                )
                for group, e in sorted(self._entries.items())
            ),
            latencies_recorded=self._latencies,
            failures_recorded=self._failures,
            successes_recorded=self._successes,
        )


__all__ = [
    "AvoidancePolicy",
    "FaultTableStatistics",
    "GroupFault",
    "LatencyFaultTable",
]
