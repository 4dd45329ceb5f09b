"""The metaserver's registry: server groups, heartbeats, eviction, states, routes.

A sans-IO object: the network server feeds it requests and the time of each,
and it never reads a clock. Its times are for intervals (silence, eviction) and
versions, so the server feeds it a steady time, one that a wall-clock step does
not move (``Metaserver``: the wall clock at start plus the monotonic time
since). Time inside it never runs backwards: an earlier ``now_ms`` than one
already seen is taken as the latest seen.

Rules, each chosen so a route answer is safe to act on:

- A server is known by (group, address) and heartbeats with ``register`` (all
  fields again) or ``heartbeat`` (group and address only). A group's kind is
  fixed by its first server; a server of another kind is refused.
- A server is *evicted* once it has been silent for ``evict_after_ms`` or more
  (``now - last_heartbeat >= evict_after_ms``), and back at its next heartbeat.
  Evicted servers stay known (``status`` shows them with their age) until
  ``forget``.
- A group's master is the server that claimed mastership last (registered as
  master when it was new, a slave, or a new ``incarnation`` of a deposed
  master). The newest claim wins at once: the group's previous master is
  *superseded*, dropped from the group (and so from routes) and remembered as
  deposed, so a dead master never holds the group until its eviction, and a
  live one cannot take the group back: its heartbeats, and its registrations as
  master with the same incarnation, are refused (``Superseded``). It may come
  back as a slave, or as master after a restart (a new incarnation, which then
  supersedes the other). A server restarting on its own address (a new
  incarnation) is live again at its registration. A group is routed while its
  master is live; its live slaves come with it.
- ``version`` changes exactly when the view behind every route answer changes.
  Each change sets it to ``max(version + 1, now_ms)``, so a metaserver restored
  from an older snapshot, or started empty, never hands out a version that an
  earlier run used for other routes.

*Managed* groups (replicated ones: their servers send a ``replica`` report) follow
other mastership rules, because there the metaserver, not the servers, decides who
is master: see ``delaymq.metaserver.mastership``.

This module is the registry's public face: the request, answer and error types
it takes and gives are importable from here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from delaymq.metaserver.answers import (
    FailoverBlocked,
    Handover,
    HandoverDropped,
    HeardAgain,
    HeartbeatReply,
    MasterChanged,
    MastershipEvent,
    RegistryStatistics,
    StatusRow,
)
from delaymq.metaserver.checks import (
    GROUP_NAME_MAX,
    MEMBER_MAX,
    check_address,
    check_choice,
    check_count,
    check_group_name,
    check_subject,
)
from delaymq.metaserver.errors import MemberTaken, RegistryError, Superseded
from delaymq.metaserver.groups import (
    DEFAULT_EVICT_AFTER_MS,
    DEFAULT_FAILOVER_AFTER_MS,
    DEFAULT_HEARTBEAT_INTERVAL_MS,
    DEPOSED_KEPT,
    HEARTBEATS_PER_FAILOVER,
    Intervals,
    RegistryState,
    ServerEntry,
    ServerGroup,
)
from delaymq.metaserver.mastership import Mastership
from delaymq.metaserver.requests import ReplicaReport, ReplicationMode, Role, ServerInfo
from delaymq.metaserver.routes import build_view, select
from delaymq.metaserver.snapshot import read_snapshot, snapshot_of
from delaymq.protocol.routes import MEMBER_TAKEN, GroupState, RouteAnswer, RoutedGroup, RouteKind, ServerKind


class Registry:
    """Server groups and the routes to them. Not thread-safe: one task drives it."""

    def __init__(
        self,
        *,
        evict_after_ms: int = DEFAULT_EVICT_AFTER_MS,
        heartbeat_interval_ms: int = DEFAULT_HEARTBEAT_INTERVAL_MS,
        failover_after_ms: int = DEFAULT_FAILOVER_AFTER_MS,
    ) -> None:
        self._intervals = Intervals(evict_after_ms, heartbeat_interval_ms, failover_after_ms)
        self._state = RegistryState(self._intervals)
        self._mastership = Mastership(self._state)
        self._now_ms = 0
        self._version = 0
        self._view: tuple[RoutedGroup, ...] = ()
        self._next_expiry_ms: int | None = None  # no live server expires before this
        self._answers: dict[RouteKind, RouteAnswer] = {}
        self._persisted_changes = 0

    # -- servers --------------------------------------------------------------

    def register(self, info: ServerInfo | Mapping[str, Any], *, now_ms: int) -> HeartbeatReply:
        """Register a server or heartbeat with all its fields."""
        if not isinstance(info, ServerInfo):
            info = ServerInfo.from_dict(info)
        group = self._state.groups.get(info.group)
        if group is not None and group.kind is not info.kind:
            raise RegistryError(
                "kind", f"group {info.group!r} is a {group.kind} group, {info.address} says {info.kind}"
            )
        if group is not None:
            self._check_member(info, group, max(self._now_ms, check_count("now_ms", now_ms)))
        if info.replica is not None or (group is not None and group.managed):
            now = self._advance(now_ms)
            self._mastership.heard(now)
            group = self._mastership.register(info, group, now)
            self._refresh(now)
            return self._reply(group, info.address)
        return self._register_claim(info, group, now_ms)

    def kind_of(self, group: str) -> ServerKind | None:
        """The kind of server ``group`` holds; None for a group this registry does not know."""
        found = self._state.groups.get(group)
        return None if found is None else found.kind

    def superseded(self, group: str) -> dict[str, str]:
        """The deposed masters of ``group`` still remembered: address -> who superseded it."""
        found = self._state.groups.get(group)
        return {} if found is None else {address: record.by for address, record in found.deposed.items()}

    def heartbeat(
        self, group: str, address: str, *, now_ms: int, replica: ReplicaReport | Mapping[str, Any] | None = None
    ) -> HeartbeatReply:
        """The light heartbeat of a registered server: (group, address), and a managed
        group's ``replica`` report."""
        found = self._group(group)
        server = found.servers.get(check_address(address))
        if replica is not None and not isinstance(replica, ReplicaReport):
            replica = ReplicaReport.from_dict(replica)
        if server is None:
            deposed = found.deposed.get(address)
            if deposed is not None and not found.managed:
                raise Superseded(group, address, deposed.by)
            raise RegistryError("address", f"{address} is not registered in group {group!r}: register first")
        now = self._advance(now_ms)
        if found.managed:
            self._mastership.heard(now)
            self._mastership.heartbeat(group, found, address, replica, now)
        else:
            self._state.beat(server, now)
        self._refresh(now)
        return self._reply(found, address)

    def handover(self, group: str, to: str | None = None, *, now_ms: int) -> Handover:
        """Admin: ask ``group``'s master to hand over to ``to`` (default: the live in-sync
        slave with the highest offset). Its heartbeat answers name the target until it
        reports ``handed_over``; then the target is promoted. Asking again for the same
        target answers the same; another target while one is pending is refused."""
        found = self._group(group)
        now = self._advance(now_ms)
        return self._mastership.handover(group, found, to, now)

    def take_events(self) -> list[MastershipEvent]:
        """The mastership changes of managed groups since the last call, oldest first (for the log)."""
        events = list(self._state.events)
        self._state.events.clear()
        return events

    @property
    def next_deadline_ms(self) -> int | None:
        """No eviction or failover is due before this time (None: none is pending), as of
        the latest call; ``expire`` at that time acts on what is due."""
        return self._next_expiry_ms

    def forget(self, group: str, address: str) -> None:
        """Admin: drop a server, or the memory of a deposed master, for good (a group left
        with neither is dropped too)."""
        found = self._group(group)
        if check_address(address) in found.servers:
            self._mastership.remove(group, found, address, reason="it was forgotten")
        elif found.deposed.pop(address, None) is None:
            raise RegistryError("address", f"{address} is not registered in group {group!r}")
        if not found.servers and not found.deposed:
            del self._state.groups[group]
        self._state.content_changed()
        self._refresh(self._now_ms)

    def set_state(self, group: str, state: GroupState | str) -> None:
        """Admin: RW, R (read-only) or NRW. Kept across re-registration and restarts."""
        found = self._group(group)
        new = check_choice("state", GroupState, state)
        if found.state is not new:
            found.state = new
            self._state.content_changed()
            self._refresh(self._now_ms)

    # -- queries --------------------------------------------------------------

    def route(self, route: RouteKind | str, *, now_ms: int, subject: str | None = None) -> RouteAnswer:
        """The groups for one route; ``subject`` is required for scheduler-delivery."""
        kind = check_choice("route", RouteKind, route)
        if subject is not None or kind is RouteKind.SCHEDULER_DELIVERY:
            check_subject(subject)
        now = self._advance(now_ms)
        self._refresh(now)
        answer = self._answers.get(kind)
        if answer is None:
            answer = self._answers[kind] = select(kind, self._view, self._version)
        return answer

    def expire(self, now_ms: int) -> bool:
        """Notice evictions due by ``now_ms``; true if the routes changed."""
        before = self._version
        self._refresh(self._advance(now_ms))
        return self._version != before

    @property
    def version(self) -> int:
        """The route version as of the latest time given (see ``route``)."""
        return self._version

    def status(self, now_ms: int) -> list[StatusRow]:
        """Every known server, sorted by group then address."""
        now = self._advance(now_ms)
        self._refresh(now)
        rows = []
        for name in sorted(self._state.groups):
            group = self._state.groups[name]
            master = group.master()
            for address in sorted(group.servers):
                server = group.servers[address]
                rows.append(
                    StatusRow(
                        group=name,
                        kind=group.kind,
                        role=server.role,
                        address=address,
                        state=group.state,
                        software_version=server.software_version,
                        seconds_since_heartbeat=(now - server.last_heartbeat_ms) / 1000,
                        evicted=not self._intervals.alive(server, now),
                        is_master=address == master,
                        epoch=group.epoch,
                        member=server.member,
                        offset=server.offset,
                        in_sync=group.managed and address in group.in_sync,
                    )
                )
        return rows

    def statistics(self) -> RegistryStatistics:
        now = self._now_ms
        self._refresh(now)
        groups = self._state.groups.values()
        alive = self._intervals.alive
        evicted_groups = 0
        for group in groups:
            master = group.master()
            if master is not None and not alive(group.servers[master], now):
                evicted_groups += 1
        return RegistryStatistics(
            groups=len(groups),
            servers=sum(len(g.servers) for g in groups),
            routed_groups=len(self._view),
            evicted_groups=evicted_groups,
            evicted_servers=sum(not alive(s, now) for g in groups for s in g.servers.values()),
            version=self._version,
            changes=self._state.changes,
            dirty=self.dirty,
        )

    # -- persistence ----------------------------------------------------------

    @property
    def changes(self) -> int:
        """Count of changes to what ``snapshot`` holds (servers, roles, states), not heartbeats."""
        return self._state.changes

    @property
    def dirty(self) -> bool:
        """True if something worth persisting changed since ``mark_persisted``."""
        return self._state.changes != self._persisted_changes

    def mark_persisted(self, changes: int) -> None:
        """Record that the snapshot taken when ``changes`` was read is now durable.

        Read ``changes``, take ``snapshot()``, write it (in a thread), then call
        this: changes made during the write keep the registry dirty.
        """
        check_count("changes", changes)
        if changes > self._state.changes:
            raise RegistryError("changes", f"is {changes}, only {self._state.changes} changes were made")
        self._persisted_changes = max(self._persisted_changes, changes)

    def snapshot(self) -> dict[str, Any]:
        """Everything but heartbeat times, as plain msgpack-able data."""
        return snapshot_of(self._state.groups, self._version, self._state.claims)

    @classmethod
    def restore(
        cls,
        snapshot: Mapping[str, Any],
        now_ms: int,
        *,
        evict_after_ms: int = DEFAULT_EVICT_AFTER_MS,
        heartbeat_interval_ms: int = DEFAULT_HEARTBEAT_INTERVAL_MS,
        failover_after_ms: int = DEFAULT_FAILOVER_AFTER_MS,
    ) -> Registry:
        """Rebuild from ``snapshot()`` so a restarted metaserver answers routes at once.

        Heartbeat times are not persisted: every server counts as heard from at
        ``now_ms`` and gets a full ``evict_after_ms`` of grace. The last known
        routes are answered at once; servers that are really gone drop out after
        the grace period, exactly as if they had stopped just now. The version
        moves past the snapshot's, since the answers may differ from the last
        ones handed out (servers evicted then are routed now). A managed group
        keeps its epoch (the next change of master moves on from there), and its
        master gets a full ``failover_after_ms`` too.
        """
        registry = cls(
            evict_after_ms=evict_after_ms,
            heartbeat_interval_ms=heartbeat_interval_ms,
            failover_after_ms=failover_after_ms,
        )
        now = registry._advance(now_ms)
        restored = read_snapshot(snapshot, now)
        registry._state.groups.update(restored.groups)
        registry._state.claims = restored.claims
        registry._view, registry._next_expiry_ms = build_view(registry._state.groups, now, registry._intervals)
        registry._version = max(restored.version + 1, now)
        return registry

    # -- internals ------------------------------------------------------------

    def _advance(self, now_ms: int) -> int:
        self._now_ms = max(self._now_ms, check_count("now_ms", now_ms))
        return self._now_ms

    def _group(self, name: str) -> ServerGroup:
        group = self._state.groups.get(check_group_name(name))
        if group is None:
            raise RegistryError("group", f"unknown group {name!r}")
        return group

    def _register_claim(self, info: ServerInfo, group: ServerGroup | None, now_ms: int) -> HeartbeatReply:
        """``register`` for a group that is not managed: the server's latest claim of mastership wins."""
        deposed = group.deposed.get(info.address) if group is not None else None
        if deposed is not None and info.role is Role.MASTER and info.incarnation == deposed.incarnation:
            raise Superseded(info.group, info.address, deposed.by)
        now = self._advance(now_ms)
        if group is None:
            group = self._state.groups[info.group] = ServerGroup(info.kind, GroupState.RW, {}, {})
        if deposed is not None:  # back as a slave, or restarted: no longer deposed
            del group.deposed[info.address]
            self._state.content_changed()
        server = group.servers.get(info.address)
        claims = info.role is Role.MASTER and (
            server is None
            or server.role is not Role.MASTER
            or (server.incarnation != info.incarnation and group.master() != info.address)
        )
        if server is None:
            server = group.servers[info.address] = ServerEntry(info.role, info.software_version, now, 0)
            self._state.content_changed()
        else:
            self._state.beat(server, now)
            if server.role is not info.role:
                server.role = info.role
                server.master_claim = 0
                self._state.content_changed()
            if server.software_version != info.software_version:
                server.software_version = info.software_version
                self._state.changes += 1  # persisted, but no route shows it
        if server.incarnation != info.incarnation:
            server.incarnation = info.incarnation
            self._state.changes += 1  # persisted, but no route shows it
        if claims:
            server.master_claim = self._state.claim()
            group.supersede(info.address)
            self._state.content_changed()
        self._refresh(now)
        return self._reply(group)

    def _check_member(self, info: ServerInfo, group: ServerGroup, now: int) -> None:
        """Refuse (changing nothing) a claim of a live member's id by another run at another address.

        A run that does not say its incarnation cannot show it is the same one.
        """
        if info.member is None:
            return
        # Live is: neither evicted nor silent past failover_after_ms (a master the metaserver
        # would fail over from): a crashed member restarted elsewhere takes its place that soon.
        live_ms = min(self._intervals.evict_after_ms, self._intervals.failover_after_ms)
        for address, server in group.servers.items():
            silent = now - server.last_heartbeat_ms
            if address == info.address or server.member != info.member or silent >= live_ms:
                continue
            if info.incarnation is not None and server.incarnation == info.incarnation:
                continue  # the same run, at a new address
            raise MemberTaken(info.group, info.member, info.address, address, silent, live_ms - silent)

    def _reply(self, group: ServerGroup, address: str | None = None) -> HeartbeatReply:
        master = group.master()
        if not group.managed or address is None:
            return HeartbeatReply(group.state, master, self._version, self._intervals.heartbeat_interval_ms)
        return HeartbeatReply(
            group.state,
            master,
            self._version,
            self._intervals.managed_interval_ms,
            role=group.servers[address].role,
            epoch=group.epoch,
            handover_to=group.handover_to if address in (master, group.handover_to) else None,
            in_sync=group.in_sync if address == master else None,
        )

    def _refresh(self, now: int) -> None:
        """Rebuild the view if something changed or a server may have expired."""
        if not self._state.view_stale and (self._next_expiry_ms is None or now < self._next_expiry_ms):
            return
        for name, group in self._state.groups.items():
            if group.managed and not group.waiting:
                self._mastership.check_failover(name, group, now)
        view, self._next_expiry_ms = build_view(self._state.groups, now, self._intervals)
        self._state.view_stale = False
        if view != self._view:
            self._view = view
            self._version = max(self._version + 1, now)
            self._answers.clear()


__all__ = [
    "DEFAULT_EVICT_AFTER_MS",
    "DEFAULT_FAILOVER_AFTER_MS",
    "DEFAULT_HEARTBEAT_INTERVAL_MS",
    "DEPOSED_KEPT",
    "GROUP_NAME_MAX",
    "HEARTBEATS_PER_FAILOVER",
    "MEMBER_MAX",
    "MEMBER_TAKEN",
    "FailoverBlocked",
    "Handover",
    "HandoverDropped",
    "HeardAgain",
    "HeartbeatReply",
    "MasterChanged",
    "MastershipEvent",
    "MemberTaken",
    "Registry",
    "RegistryError",
    "RegistryStatistics",
    "ReplicaReport",
    "ReplicationMode",
    "Role",
    "ServerInfo",
    "StatusRow",
    "Superseded",
    "check_address",
    "check_group_name",
]
