"""What servers tell the registry: register requests and replica reports, checked when built."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from delaymq.metaserver.checks import (
    IN_SYNC_MAX,
    INCARNATION_MAX,
    INT_MAX,
    MEMBER_MAX,
    SOFTWARE_VERSION_MAX,
    check_address,
    check_choice,
    check_count,
    check_group_name,
    check_mapping,
    check_text,
)
from delaymq.metaserver.errors import RegistryError
from delaymq.protocol.routes import ServerKind


class Role(enum.StrEnum):
    """What a server says it is within its server group (in a managed group: what the metaserver says)."""

    MASTER = "master"
    SLAVE = "slave"


class ReplicationMode(enum.StrEnum):
    """How a server group's master answers writes: after its slaves hold them (sync) or not."""

    SYNC = "sync"
    ASYNC = "async"


@dataclass(frozen=True, slots=True)
class ReplicaReport:
    """What a server of a managed group says of its copy at each registration and heartbeat."""

    offset: int  # the end of its message log that is durable on its disk
    epoch: int  # the epoch it holds (0 before it knows one)
    mode: ReplicationMode | None = None  # master only
    in_sync: tuple[str, ...] = ()  # master only: the slaves it considers in sync now
    handed_over: int | None = None  # master only: the epoch it handed over, after a handover request

    def __post_init__(self) -> None:
        check_count("replica.offset", self.offset, maximum=INT_MAX)
        check_count("replica.epoch", self.epoch, maximum=INT_MAX)
        if self.mode is not None:
            object.__setattr__(self, "mode", check_choice("replica.mode", ReplicationMode, self.mode))
        if len(self.in_sync) > IN_SYNC_MAX:
            raise RegistryError("replica.in_sync", f"lists {len(self.in_sync)} addresses, limit {IN_SYNC_MAX}")
        for i, address in enumerate(self.in_sync):
            check_address(address, f"replica.in_sync[{i}]")
        if self.handed_over is not None:
            check_count("replica.handed_over", self.handed_over, maximum=INT_MAX)

    @classmethod
    def from_dict(cls, report: object) -> ReplicaReport:
        """From the decoded ``replica`` field; unknown keys are ignored."""
        data = check_mapping("replica", report)
        for key in ("offset", "epoch"):
            if key not in data:
                raise RegistryError(f"replica.{key}", "is missing")
        in_sync = data.get("in_sync")
        if in_sync is None:
            in_sync = ()
        elif not isinstance(in_sync, list | tuple):
            raise RegistryError("replica.in_sync", f"must be a list of addresses, got {type(in_sync).__name__}")
        return cls(
            data["offset"],
            data["epoch"],
            mode=data.get("mode"),
            in_sync=tuple(in_sync),
            handed_over=data.get("handed_over"),
        )


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """A register request, checked and normalised when built."""

    group: str
    kind: ServerKind
    role: Role
    address: str
    software_version: str
    #: New at every start of the server: tells a restart from a deposed master still running.
    incarnation: str | None = None
    #: A stable id of the server's data folder: the server's identity across addresses.
    member: str | None = None
    #: Present for the servers of managed (replicated) groups.
    replica: ReplicaReport | None = None

    def __post_init__(self) -> None:
        check_group_name(self.group)
        object.__setattr__(self, "kind", check_choice("kind", ServerKind, self.kind))
        object.__setattr__(self, "role", check_choice("role", Role, self.role))
        check_address(self.address)
        check_text("software_version", self.software_version, SOFTWARE_VERSION_MAX)
        if self.incarnation is not None:
            check_text("incarnation", self.incarnation, INCARNATION_MAX)
        if self.member is not None:
            check_text("member", self.member, MEMBER_MAX)
        if self.replica is not None and not isinstance(self.replica, ReplicaReport):
            raise RegistryError("replica", f"must be a ReplicaReport, got {type(self.replica).__name__}")

    @classmethod
    def from_dict(cls, request: Mapping[str, Any]) -> ServerInfo:
        """From a decoded request; unknown keys are ignored (newer servers may send more)."""
        if not isinstance(request, Mapping):
            raise RegistryError("request", f"must be a mapping, got {type(request).__name__}")
        fields = ("group", "kind", "role", "address", "software_version")
        for key in fields:
            if key not in request:
                raise RegistryError(key, "is missing")
        group, kind, role, address, version = (request[key] for key in fields)
        return cls(
            group,
            kind,
            role,
            address,
            version,
            incarnation=request.get("incarnation"),
            member=request.get("member"),
            replica=None if request.get("replica") is None else ReplicaReport.from_dict(request["replica"]),
        )


__all__ = ["ReplicaReport", "ReplicationMode", "Role", "ServerInfo"]
