"""Mastership of managed server groups: promotions, failovers and handovers.

*Managed* groups (replicated ones: their servers send a ``replica`` report) follow
other mastership rules than the claim rules of ``delaymq.metaserver.registry``,
because there the metaserver, not the servers, decides who is master:

- The first server of the group is its master; every later one is a slave, whatever
  role it registers with. Each change of master (the first, a failover, a graceful
  handover, a restart of the master) sets the group's *epoch* to ``max(epoch + 1,
  now_ms)`` (and above any epoch a server reports holding), so an epoch is never
  reused, even by a metaserver restored from an old snapshot.
- A server is known by its ``member`` id (its data folder) when it sends one: the same
  member at a new address takes over its entry and standing; another member at a
  known address replaces that entry (a new folder holds none of the old one's data).
  A member id belongs to the run (``incarnation``) that registered it while that run
  is live: another run claiming it from another address is refused (``MemberTaken``)
  until the old address is evicted, since the id is no secret (STATUS shows it). The
  same run may move, and a new run at the same address is a restart.
- The group's *in-sync set* is what its master reported at the group's epoch (a report
  of another epoch records nothing); the master learns the recorded set in each
  heartbeat answer and stops waiting for a slave only once it is recorded without it.
- The master silent for ``failover_after_ms`` is replaced by the live slave that is in
  the recorded in-sync set and holds the highest offset (tie: the lowest address); with
  none eligible the group waits for its master. The deposed master is
  kept as a slave: its next heartbeat is answered "you are a slave", not refused.
- ``handover`` asks the master to hand the group to an in-sync slave; the slave is
  promoted when the master reports ``handed_over`` equal to the epoch.
"""

from __future__ import annotations

from delaymq.metaserver.answers import FailoverBlocked, Handover, HandoverDropped, HeardAgain, MasterChanged
from delaymq.metaserver.checks import check_address
from delaymq.metaserver.errors import RegistryError
from delaymq.metaserver.groups import RegistryState, ServerEntry, ServerGroup
from delaymq.metaserver.requests import ReplicaReport, Role, ServerInfo
from delaymq.protocol.routes import GroupState


class Mastership:
    """Decides who is master of each managed group; shares the registry's state."""

    def __init__(self, state: RegistryState) -> None:
        self._state = state
        self._intervals = state.intervals

    # -- registrations and heartbeats ------------------------------------------

    def heard(self, now: int) -> None:
        """A server of a managed group was heard. When none was for a failover time, the metaserver
        itself was cut off or frozen: each server's silence counts from before that began, so a
        master is not failed over for a silence that was the metaserver's (nor evicted)."""
        state = self._state
        last, state.managed_heard_ms = state.managed_heard_ms, now
        gap = now - last
        if not last or gap < self._intervals.failover_after_ms:
            return
        for group in state.groups.values():
            if group.managed:
                for server in group.servers.values():
                    server.last_heartbeat_ms = min(now, server.last_heartbeat_ms + gap)
        state.view_stale = True
        state.events.append(HeardAgain(gap))

    def register(self, info: ServerInfo, group: ServerGroup | None, now: int) -> ServerGroup:
        """``register`` for a managed group: the metaserver, not the server, says who is master."""
        name, address = info.group, info.address
        if group is None:
            group = self._state.groups[name] = ServerGroup(info.kind, GroupState.RW, {}, {})
        if not group.managed:
            self._manage(name, group, now)
        self.check_failover(name, group, now)  # before this registration counts as a beat
        server, previous, restarted = self._entry(info, group, now)
        if info.replica is not None:
            server.epoch = info.replica.epoch  # a new term must be above it
        if group.master() is None and not self.check_failover(name, group, now):
            # A new group, or one whose master left with no slave to replace it.
            self.promote(name, group, address, now, reason="first")
        elif restarted:  # a new run of the master: a new term, so nothing of the old run passes as current
            self.promote(name, group, address, now, reason="restart", previous=previous)
        if info.replica is not None:  # after the promotions: a new master's report counts as the master's
            self._report(name, group, address, info.replica, now)
        return group

    def heartbeat(self, name: str, group: ServerGroup, address: str, replica: ReplicaReport | None, now: int) -> None:
        """A managed group's heartbeat: it may complete a handover, or let a failover happen."""
        self.check_failover(name, group, now)  # before this beat counts: the master may be gone
        self._state.beat(group.servers[address], now)
        if replica is not None:
            self._report(name, group, address, replica, now)
        self.check_failover(name, group, now)  # a slave eligible again

    def _manage(self, name: str, group: ServerGroup, now: int) -> None:
        """A group turns managed (its first replica report): its master, if any, starts the first term."""
        group.managed = True
        group.deposed.clear()  # the claim rules are over: deposed masters come back as slaves
        self._state.content_changed()
        master = group.master()
        if master is not None:
            self.promote(name, group, master, now, reason="first")

    def _entry(self, info: ServerInfo, group: ServerGroup, now: int) -> tuple[ServerEntry, str, bool]:
        """The registering server's entry, the address its standing was at, and whether
        it is the master restarted (a new term is due)."""
        name, address = info.group, info.address
        server = group.servers.get(address)
        if server is not None and None not in (info.member, server.member) and server.member != info.member:
            # Another data folder at this address: the old one's standing does not pass to it.
            self.remove(name, group, address, reason=f"member {info.member} replaced member {server.member}")
            server = None
        holder = None
        if info.member is not None:
            holder = next((a for a, s in group.servers.items() if s.member == info.member and a != address), None)
        previous, moved_master = address, False
        if holder is not None:  # the member moved (restarted on another address): same standing
            server = self._move(name, group, holder, info)
            previous, moved_master = holder, server.role is Role.MASTER
        if server is None:
            server = group.servers[address] = ServerEntry(
                Role.SLAVE, info.software_version, now, 0, info.incarnation, info.member
            )
            self._state.content_changed()
            return server, previous, moved_master
        return server, previous, self._heard_again(info, server, now) or moved_master

    def _move(self, name: str, group: ServerGroup, holder: str, info: ServerInfo) -> ServerEntry:
        """The member at ``holder`` now registers from ``info.address``: its entry moves there."""
        address = info.address
        if address in group.servers:
            self.remove(name, group, address, reason=f"member {info.member} moved to its address")
        server = group.servers[address] = group.servers.pop(holder)
        group.in_sync = tuple(sorted(address if a == holder else a for a in group.in_sync))
        if group.handover_to == holder:
            group.handover_to = address
        self._state.content_changed()
        return server

    def _heard_again(self, info: ServerInfo, server: ServerEntry, now: int) -> bool:
        """A known server registers again; true if it is the master, restarted."""
        self._state.beat(server, now)
        restarted = False
        if server.incarnation != info.incarnation:
            restarted = server.role is Role.MASTER
            server.incarnation = info.incarnation
            self._state.changes += 1  # persisted, but no route shows it
        if server.software_version != info.software_version:
            server.software_version = info.software_version
            self._state.changes += 1
        if info.member is not None and server.member != info.member:
            server.member = info.member
            self._state.changes += 1
        return restarted

    def _report(self, name: str, group: ServerGroup, address: str, report: ReplicaReport, now: int) -> None:
        """Take in a server's replica report; a master's may complete a handover.

        The in-sync set is recorded only from the master, and only at the group's epoch: a
        report of an earlier term (a deposed master, or the new one before its term began)
        changes nothing, so no master can drop a slave the metaserver may still promote."""
        server = group.servers[address]
        server.offset = report.offset  # persisted with the next snapshot, not worth one of its own
        server.epoch = report.epoch
        if server.role is not Role.MASTER or report.epoch != group.epoch:
            return
        in_sync = tuple(sorted(set(report.in_sync) - {address}))
        if in_sync != group.in_sync:
            group.in_sync = in_sync
            self._state.changes += 1  # persisted: a restarted metaserver must know whom it may promote
        target = group.handover_to
        if target is None:
            return
        if not self._intervals.responsive(group.servers[target], now):
            group.handover_to = None
            self._state.changes += 1
            silent = self._intervals.silent_s(group, target, now)
            self._state.events.append(HandoverDropped(name, target, f"it has not heartbeated for {silent}"))
        elif report.handed_over == group.epoch:
            self.promote(name, group, target, now, reason="handover")

    def remove(self, name: str, group: ServerGroup, address: str, *, reason: str) -> None:
        """Drop a server's entry, and what of the group refers to it."""
        del group.servers[address]
        if address in group.in_sync:
            group.in_sync = tuple(a for a in group.in_sync if a != address)
        if group.handover_to == address:
            group.handover_to = None
            self._state.events.append(HandoverDropped(name, address, reason))
        self._state.content_changed()

    # -- failover and promotion -------------------------------------------------

    def _best_slave(self, group: ServerGroup, now: int) -> str | None:
        """The live in-sync slave with the highest reported offset (tie: the lowest address)."""
        eligible = [
            (-(server.offset or 0), address)
            for address in group.in_sync
            if (server := group.servers.get(address)) is not None
            and server.role is Role.SLAVE
            and self._intervals.responsive(server, now)
        ]
        return min(eligible)[1] if eligible else None

    def check_failover(self, name: str, group: ServerGroup, now: int) -> bool:
        """Replace a master silent for ``failover_after_ms`` if a slave may; true if one did."""
        if not group.managed:
            return False
        master = group.master()
        silent = 0
        if master is not None:
            silent = now - group.servers[master].last_heartbeat_ms
            if silent < self._intervals.failover_after_ms:
                group.waiting = False
                return False
        candidate = self._best_slave(group, now)
        if candidate is None:
            if master is not None and not group.waiting:
                group.waiting = True
                self._state.events.append(FailoverBlocked(name, master, silent, group.in_sync))
            return False
        self.promote(name, group, candidate, now, reason="failover", silent_ms=silent)
        return True

    def promote(
        self,
        name: str,
        group: ServerGroup,
        address: str,
        now: int,
        *,
        reason: str,
        silent_ms: int = 0,
        previous: str | None = None,
    ) -> None:
        """``address`` starts a new term as master: the epoch moves on, never to a value used before."""
        old = group.master()
        new = group.servers[address]
        if old is not None and old != address:
            group.servers[old].role = Role.SLAVE
            group.servers[old].master_claim = 0
        if old != address:
            new.role = Role.MASTER
            new.master_claim = self._state.claim()
        held = max(server.epoch for server in group.servers.values())
        group.epoch = max(group.epoch + 1, now, held + 1)
        if reason == "handover":
            group.in_sync = (old,) if old is not None else ()  # it handed over all it had
        elif reason != "restart":
            group.in_sync = ()  # the new master says who follows it
        if group.handover_to is not None and reason != "handover":
            self._state.events.append(HandoverDropped(name, group.handover_to, f"the master changed ({reason})"))
        group.handover_to = None
        group.waiting = False
        self._state.content_changed()
        if reason == "first":
            old = None
        elif reason == "restart":
            old = previous
        self._state.events.append(MasterChanged(name, old, address, group.epoch, reason, silent_ms, new.offset))

    # -- handovers ----------------------------------------------------------------

    def handover(self, name: str, group: ServerGroup, to: str | None, now: int) -> Handover:
        """Ask the master to hand ``group`` over to ``to`` (see ``Registry.handover``)."""
        if not group.managed:
            raise RegistryError(
                "group",
                f"group {name!r} is not replicated: its servers report no replica state, so the metaserver "
                "does not choose its master",
            )
        self.check_failover(name, group, now)
        master = group.master()
        if master is None or not self._intervals.responsive(group.servers[master], now):
            silent = "" if master is None else f" ({master} silent for {self._intervals.silent_s(group, master, now)})"
            raise RegistryError("group", f"group {name!r} has no live master to hand over from{silent}")
        target = self._handover_target(name, group, master, to, now)
        if group.handover_to is not None and group.handover_to != target:
            raise RegistryError(
                "to",
                f"a handover of group {name!r} to {group.handover_to} is pending; it ends with that "
                "server's promotion, or when it leaves the group or falls silent",
            )
        if group.handover_to != target:
            group.handover_to = target
            self._state.changes += 1  # persisted, but no route shows it
        return Handover(name, group.epoch, master, target)

    def _handover_target(self, name: str, group: ServerGroup, master: str, to: str | None, now: int) -> str:
        """``to``, checked, or the best in-sync slave when it is None."""
        in_sync = ", ".join(group.in_sync) or "none"
        if to is None:
            target = self._best_slave(group, now)
            if target is None:
                raise RegistryError(
                    "to", f"group {name!r} has no live in-sync slave to hand over to (in sync: {in_sync})"
                )
            return target
        target = check_address(to, "to")
        server = group.servers.get(target)
        if target == master:
            raise RegistryError("to", f"{target} is already the master of group {name!r}")
        if server is None:
            raise RegistryError("to", f"{target} is not a server of group {name!r}")
        if not self._intervals.responsive(server, now):
            raise RegistryError(
                "to", f"{target} has not heartbeated for {self._intervals.silent_s(group, target, now)}"
            )
        if target not in group.in_sync:
            raise RegistryError(
                "to", f"{target} is not in sync with master {master} of group {name!r} (in sync: {in_sync})"
            )
        return target


__all__ = ["Mastership"]
