"""The metaserver's request handlers: each command read from the wire, applied to the
registry at the steady time of its arrival, and answered once any change is written.

Wire metadata (msgpack maps) of each command:

- ``REGISTER {group, kind, role, address, version, incarnation?, member?,
  replica?}`` and ``HEARTBEAT {group, address, replica?}`` answer ``{state,
  master, route_version, heartbeat_interval_ms}``; a heartbeat from a server this
  metaserver does not know is refused with code ``register_first``; one from a
  master another server has superseded (the newest registration of a server group's
  master wins), and its registrations as master with the same ``incarnation``,
  with code ``superseded``. With a tokens file, a REGISTER is checked against the
  token's ``servers`` by the transport, and a HEARTBEAT here, as the kind of its
  server group (``forbidden``, field ``servers``, before anything is looked up or
  changed). A REGISTER whose ``member`` is live at another address under another
  ``incarnation`` is refused with code ``member_taken`` (the id is no secret: it
  stays with the run that registered it until that one is evicted). Servers of a
  managed server group (they send ``replica``: ``{offset, epoch, mode?, in_sync?,
  handed_over?}``) are never superseded: the answer adds ``role`` and ``epoch``
  (and ``handover_to`` to the master while a handover is pending), and the
  metaserver decides who is master.
- ``HANDOVER {group, to?}`` asks a managed server group's master to hand over to ``to``
  (default: its best in-sync slave); answers ``{group, epoch, from, to}``.
- ``ROUTE {route, subject?, known_version?}`` answers ``{version, groups: [{group,
  kind, state, address, slaves}]}``, or ``{version, unchanged: true}`` when
  ``known_version`` is the current version.
- ``SET_STATE {group, state}`` answers ``{state, previous}``.
- ``STATUS {}`` answers ``{now_ms, route_version, evict_after_ms,
  heartbeat_interval_ms, failover_after_ms, rows: [{group, kind, role, address,
  state, version, seconds_since_heartbeat, evicted, is_master, epoch, member,
  offset, in_sync}]}``.
- ``PING {}`` answers ``{now_ms}``.

Refusals are ``bad_request`` errors naming the field (``register_first``,
``superseded``, ``member_taken`` and ``forbidden`` aside). SET_STATE and HANDOVER
are logged with the name of the token that asked (both are admin only).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from delaymq.clock import Clock
from delaymq.metaserver.answers import HeartbeatReply
from delaymq.metaserver.checks import check_address, check_group_name
from delaymq.metaserver.errors import MemberTaken, RegistryError, Superseded
from delaymq.metaserver.registry import Registry
from delaymq.metaserver.requests import ReplicaReport, ServerInfo
from delaymq.metaserver.timers import SteadyTime
from delaymq.metaserver.wire import asked_by, heartbeat_answer, metadata_field, refusals, status_answer_row
from delaymq.net.auth import require_server
from delaymq.net.requests import Handler, Request
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import RemoteProtocolError
from delaymq.protocol.routes import REGISTER_FIRST, SUPERSEDED

# One logger name for every metaserver log line, whichever module writes it.
log = logging.getLogger("delaymq.metaserver.server")

#: Called with the steady time of a request once the registry has taken it:
#: writes the snapshot if it changed, then logs what changed.
Settle = Callable[[int], Awaitable[None]]


class RequestHandlers:
    """The handlers of the metaserver's commands, all against the one registry."""

    def __init__(
        self,
        registry: Registry,
        clock: Clock,
        steady: SteadyTime,
        *,
        settle: Settle,
        known: set[tuple[str, str]],
        evict_after_ms: int,
        heartbeat_interval_ms: int,
        failover_after_ms: int,
    ) -> None:
        """``known``: the (server group, address) pairs already registered, so only a new
        server's registration is logged; the intervals are the registry's own, for STATUS."""
        self._registry = registry
        self._clock = clock
        self._steady = steady
        self._settle = settle
        self._known = known
        self._evict_after_ms = evict_after_ms
        self._heartbeat_interval_ms = heartbeat_interval_ms
        self._failover_after_ms = failover_after_ms

    def table(self) -> dict[int, Handler]:
        return {
            Command.PING: self.ping,
            Command.REGISTER: self.register,
            Command.HEARTBEAT: self.heartbeat,
            Command.ROUTE: self.route,
            Command.SET_STATE: self.set_state,
            Command.STATUS: self.status,
            Command.HANDOVER: self.handover,
        }

    async def ping(self, request: Request) -> dict[str, Any]:
        return {"now_ms": self._clock.now_ms()}

    async def register(self, request: Request) -> dict[str, Any]:
        info = _server_info(request)
        now = self._steady.now_ms()
        changes = self._registry.changes
        deposed_before = self._registry.superseded(info.group)
        with refusals("REGISTER"):
            try:
                reply = self._registry.register(info, now_ms=now)
            except MemberTaken as error:
                log.warning(
                    "refused REGISTER of %s in group %s (%s): member %s is live at %s",
                    info.address,
                    info.group,
                    asked_by(request),
                    error.member,
                    error.address,
                )
                raise
        self._log_registration(info, reply, changed=self._registry.changes != changes)
        self._log_superseded(info.group, deposed_before)
        await self._settle(now)
        return heartbeat_answer(reply)

    async def heartbeat(self, request: Request) -> dict[str, Any]:
        md = request.metadata
        group = metadata_field("HEARTBEAT", md, "group", str)
        address = metadata_field("HEARTBEAT", md, "address", str)
        with refusals("HEARTBEAT"):
            check_group_name(group)
        kind = self._registry.kind_of(group)
        if kind is not None:  # an unknown server group is told to register, which the transport checks
            require_server(request.identity, "HEARTBEAT", kind.value, group)
        with refusals("HEARTBEAT"):
            check_address(address)
            replica = None if md.get("replica") is None else ReplicaReport.from_dict(md["replica"])
        now = self._steady.now_ms()
        try:
            reply = self._registry.heartbeat(group, address, now_ms=now, replica=replica)
        except Superseded as error:
            raise RemoteProtocolError(f"HEARTBEAT: {error.args[0]}", code=SUPERSEDED, field=error.field) from None
        except RegistryError as error:  # well-formed, so: not registered here
            raise RemoteProtocolError(
                f"HEARTBEAT: {error}; send REGISTER", code=REGISTER_FIRST, field=error.field
            ) from None
        await self._settle(now)  # a promotion (a handover completed) is written before it is told
        return heartbeat_answer(reply)

    async def route(self, request: Request) -> dict[str, Any]:
        md = request.metadata
        route = metadata_field("ROUTE", md, "route", str)
        subject = metadata_field("ROUTE", md, "subject", str, required=False)
        known = metadata_field("ROUTE", md, "known_version", int, required=False)
        now = self._steady.now_ms()
        with refusals("ROUTE"):
            answer = self._registry.route(route, now_ms=now, subject=subject)
        await self._settle(now)  # a failover noticed just now is written before routes show it
        if known is not None and known == answer.version:
            return {"version": answer.version, "unchanged": True}
        return answer.as_dict()

    async def set_state(self, request: Request) -> dict[str, Any]:
        md = request.metadata
        group = metadata_field("SET_STATE", md, "group", str)
        state = metadata_field("SET_STATE", md, "state", str)
        now = self._steady.now_ms()
        with refusals("SET_STATE"):
            check_group_name(group)
            previous = next((row.state for row in self._registry.status(now) if row.group == group), None)
            if previous is None:
                raise RegistryError("group", f"unknown group {group!r}")
            self._registry.set_state(group, state)
        current = next(row.state for row in self._registry.status(now) if row.group == group)
        if current is not previous:
            log.info("group %s state changed %s -> %s (asked by %s)", group, previous, current, asked_by(request))
        await self._settle(now)
        return {"state": current.value, "previous": previous.value}

    async def status(self, request: Request) -> dict[str, Any]:
        now = self._steady.now_ms()
        rows = self._registry.status(now)
        await self._settle(now)
        return {
            "now_ms": self._clock.now_ms(),
            "route_version": self._registry.version,
            "evict_after_ms": self._evict_after_ms,
            "heartbeat_interval_ms": self._heartbeat_interval_ms,
            "failover_after_ms": self._failover_after_ms,
            "rows": [status_answer_row(row) for row in rows],
        }

    async def handover(self, request: Request) -> dict[str, Any]:
        md = request.metadata
        group = metadata_field("HANDOVER", md, "group", str)
        to = metadata_field("HANDOVER", md, "to", str, required=False)
        now = self._steady.now_ms()
        with refusals("HANDOVER"):
            handover = self._registry.handover(group, to, now_ms=now)
        log.info(
            "group %s: handover from master %s to %s asked by %s at epoch %d",
            group,
            handover.from_address,
            handover.to_address,
            asked_by(request),
            handover.epoch,
        )
        await self._settle(now)
        return {"group": group, "epoch": handover.epoch, "from": handover.from_address, "to": handover.to_address}

    def _log_registration(self, info: ServerInfo, reply: HeartbeatReply, *, changed: bool) -> None:
        """Log a new server, or an unmanaged one whose registration changed what the registry holds."""
        if (info.group, info.address) not in self._known:
            self._known.add((info.group, info.address))
            assigned = info.role if reply.role is None else f"{reply.role} (epoch {reply.epoch})"
            log.info(
                "server %s registered: %s of %s group %s (version %s)",
                info.address,
                assigned,
                info.kind,
                info.group,
                info.software_version,
            )
        elif reply.role is None and changed:
            log.info(
                "server %s of group %s now registers as %s (version %s)",
                info.address,
                info.group,
                info.role,
                info.software_version,
            )

    def _log_superseded(self, group: str, deposed_before: dict[str, str]) -> None:
        """Log each master of ``group`` this registration superseded, and forget it as registered."""
        for old, by in self._registry.superseded(group).items():
            if deposed_before.get(old) != by:
                self._known.discard((group, old))
                log.warning(
                    "server %s superseded %s as master of group %s: %s is dropped from routes at once, "
                    "and refused if it is still running",
                    by,
                    old,
                    group,
                    old,
                )


def _server_info(request: Request) -> ServerInfo:
    """A REGISTER's fields, checked: a missing or mistyped one, or a bad value, is refused."""
    md = request.metadata
    group, kind, role, address, version = (
        metadata_field("REGISTER", md, name, str) for name in ("group", "kind", "role", "address", "version")
    )
    incarnation = metadata_field("REGISTER", md, "incarnation", str, required=False)
    member = metadata_field("REGISTER", md, "member", str, required=False)
    replica = md.get("replica")
    with refusals("REGISTER"):
        report = None if replica is None else ReplicaReport.from_dict(replica)
        return ServerInfo(group, kind, role, address, version, incarnation=incarnation, member=member, replica=report)


__all__ = ["RequestHandlers", "Settle"]
