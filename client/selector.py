"""Which server group of a route the next send goes to.

Round robin over the groups the fault table does not avoid, so load spreads
evenly and a slow or broken group is left alone for a while. When every group
is avoided the send still goes somewhere (the group available soonest), since
a route with only sick groups is better tried than refused. ``exclude`` holds
the groups already tried for this send, so a send refused by one group goes
to another. Sans-IO: the time is passed in, nothing here reads a clock.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

from delaymq.client.faults import AvoidancePolicy, LatencyFaultTable


class NoGroupError(LookupError):
    """The route holds no group to send to."""


@dataclass(frozen=True, slots=True)
class SelectorStatistics:
    groups: tuple[str, ...]
    picks: int  # every pick
    avoided_picks: int  # picks of an avoided group because no untried group was available
    repeated_picks: int  # picks of an excluded (already tried) group because every group was tried


class GroupSelector:
    """Round robin over a route's groups, skipping avoided and already-tried ones.

    By default the selector owns its fault table and drops a vanished group's entry
    on ``update_groups``. Pass ``faults`` to share one table among the selectors of
    several routes (a group serves many subjects, and a broken group is broken for
    all of them); the table's owner then prunes it (``LatencyFaultTable.retain``).
    """

    def __init__(
        self,
        groups: Iterable[str] = (),
        *,
        faults: LatencyFaultTable | None = None,
        policy: AvoidancePolicy | None = None,
    ) -> None:
        if faults is not None and policy is not None:
            raise ValueError("policy must not be given with faults: a shared table carries its own")
        self._owns_faults = faults is None
        self.faults = faults if faults is not None else LatencyFaultTable(policy)
        self._groups: tuple[str, ...] = ()
        self._cursor = 0  # index of the group the rotation tries first
        self._picks = 0
        self._avoided_picks = 0
        self._repeated_picks = 0
        self.update_groups(groups)

    @property
    def groups(self) -> tuple[str, ...]:
        return self._groups

    def update_groups(self, groups: Iterable[str]) -> None:
        """Take the route's new groups: vanished ones leave, new ones join the rotation."""
        new = tuple(dict.fromkeys(groups))  # dedupe, keep the route's order
        for group in new:
            if not isinstance(group, str) or not group:
                raise ValueError(f"groups entry {group!r} must be a non-empty str")
        if self._owns_faults:
            kept = set(new)
            for group in self._groups:
                if group not in kept:
                    self.faults.forget(group)
        # Keep the rotation's place: the group due next stays due next if it is still there.
        due = self._groups[self._cursor] if self._groups else None
        self._groups = new
        if due is not None and due in new:
            self._cursor = new.index(due)
        else:
            self._cursor = self._cursor % len(new) if new else 0

    def pick(self, now_ms: int, *, exclude: Collection[str] = ()) -> str:
        """The group for the next send (or retry, with the groups tried so far in ``exclude``).

        In order of preference: an untried available group (round robin); an untried
        avoided group (the one available soonest, then least recently failed); a tried
        group, by the same two rules. Raises ``NoGroupError`` on an empty route.
        """
        n = len(self._groups)
        if n == 0:
            raise NoGroupError("groups: the route holds 0 groups, at least 1 is needed to send")
        order = [self._groups[(self._cursor + i) % n] for i in range(n)]
        untried = [g for g in order if g not in exclude] if exclude else order
        candidates = untried or order
        if not untried:
            self._repeated_picks += 1
        faults = self.faults
        chosen = next((g for g in candidates if faults.is_available(g, now_ms)), None)
        if chosen is None:
            chosen = faults.soonest_available(candidates)
            assert chosen is not None  # candidates is never empty here
            self._avoided_picks += 1
        self._picks += 1
        self._cursor = (self._groups.index(chosen) + 1) % n
        return chosen

    def statistics(self) -> SelectorStatistics:
        return SelectorStatistics(
            groups=self._groups,
            picks=self._picks,
            avoided_picks=self._avoided_picks,
            repeated_picks=self._repeated_picks,
        )


__all__ = ["GroupSelector", "NoGroupError", "SelectorStatistics"]
