"""The registry's snapshot: everything but heartbeat times, as plain msgpack-able data.

The metaserver writes one to its lmdb store after each change worth keeping and
restores from it at start. ``read_snapshot`` checks every field, so a damaged
or foreign snapshot is refused, naming the field, rather than half-loaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from delaymq.metaserver.checks import (
    INCARNATION_MAX,
    INT_MAX,
    MEMBER_MAX,
    SOFTWARE_VERSION_MAX,
    check_address,
    check_choice,
    check_count,
    check_group_name,
    check_mapping,
    check_optional_text,
    check_text,
    shown,
)
from delaymq.metaserver.errors import RegistryError
from delaymq.metaserver.groups import DeposedMaster, ServerEntry, ServerGroup
from delaymq.metaserver.requests import Role
from delaymq.protocol.routes import GroupState, ServerKind

SNAPSHOT_FORMAT = 3
#: Snapshot formats ``restore`` reads (1: before incarnations and deposed masters;
#: 2: before managed groups, epochs and members).
SNAPSHOT_FORMATS_READ = (1, 2, 3)


@dataclass(frozen=True, slots=True)
class RestoredSnapshot:
    """What a snapshot held: its server groups, route version and count of master claims."""

    groups: dict[str, ServerGroup]
    version: int
    claims: int  # at least every restored server's claim


def snapshot_of(groups: Mapping[str, ServerGroup], version: int, claims: int) -> dict[str, Any]:
    """The snapshot of a registry holding ``groups``."""
    return {
        "format": SNAPSHOT_FORMAT,
        "version": version,
        "master_claims": claims,
        "groups": [_group_entry(name, group) for name, group in sorted(groups.items())],
    }


def _group_entry(name: str, group: ServerGroup) -> dict[str, Any]:
    return {
        "group": name,
        "kind": group.kind.value,
        "state": group.state.value,
        "servers": [
            {
                "address": address,
                "role": server.role.value,
                "software_version": server.software_version,
                "master_claim": server.master_claim,
                "incarnation": server.incarnation,
                "member": server.member,
                "offset": server.offset,
            }
            for address, server in sorted(group.servers.items())
        ],
        "deposed": [
            {"address": address, "incarnation": record.incarnation, "by": record.by}
            for address, record in group.deposed.items()
        ],
        "managed": group.managed,
        "epoch": group.epoch,
        "master": group.master(),
        "in_sync": list(group.in_sync),
        "handover_to": group.handover_to,
    }


def read_snapshot(snapshot: Mapping[str, Any], now: int) -> RestoredSnapshot:
    """The groups of ``snapshot``, every server counted as heard from at ``now``."""
    data = check_mapping("snapshot", snapshot)
    if data.get("format") not in SNAPSHOT_FORMATS_READ:
        raise RegistryError(
            "snapshot.format",
            f"is {shown(data.get('format'))}, this code reads {' or '.join(map(str, SNAPSHOT_FORMATS_READ))}",
        )
    version = check_count("snapshot.version", data.get("version"))
    claims = check_count("snapshot.master_claims", data.get("master_claims"))
    entries = data.get("groups")
    if not isinstance(entries, list):
        raise RegistryError("snapshot.groups", "must be a list")
    groups: dict[str, ServerGroup] = {}
    for i, raw in enumerate(entries):
        where = f"snapshot.groups[{i}]"
        entry = check_mapping(where, raw)
        name = check_group_name(entry.get("group"), f"{where}.group")
        if name in groups:
            raise RegistryError(f"{where}.group", f"{name!r} appears twice")
        group = ServerGroup(
            check_choice(f"{where}.kind", ServerKind, entry.get("kind")),
            check_choice(f"{where}.state", GroupState, entry.get("state")),
            {},
            {},
        )
        claims = max(claims, _restore_servers(where, entry, group, now))
        _restore_deposed(where, entry, group)
        _restore_managed(where, entry, group)
        groups[name] = group
    return RestoredSnapshot(groups, version, claims)


def _restore_servers(where: str, entry: Mapping[str, Any], group: ServerGroup, now: int) -> int:
    """Fill ``group.servers`` from a snapshot group; the highest master claim among them."""
    servers = entry.get("servers")
    if not isinstance(servers, list) or not servers:
        raise RegistryError(f"{where}.servers", "must be a non-empty list")
    claims = 0
    for j, raw_server in enumerate(servers):
        at = f"{where}.servers[{j}]"
        item = check_mapping(at, raw_server)
        address = check_address(item.get("address"), f"{at}.address")
        role = check_choice(f"{at}.role", Role, item.get("role"))
        claim = check_count(f"{at}.master_claim", item.get("master_claim"), minimum=1 if role is Role.MASTER else 0)
        version = check_text(f"{at}.software_version", item.get("software_version"), SOFTWARE_VERSION_MAX)
        incarnation = check_optional_text(f"{at}.incarnation", item.get("incarnation"), INCARNATION_MAX)
        member = check_optional_text(f"{at}.member", item.get("member"), MEMBER_MAX)
        offset = item.get("offset")
        if offset is not None:
            check_count(f"{at}.offset", offset, maximum=INT_MAX)
        group.servers[address] = ServerEntry(
            role, version, now, claim if role is Role.MASTER else 0, incarnation, member, offset
        )
        claims = max(claims, claim)
    return claims


def _restore_deposed(where: str, entry: Mapping[str, Any], group: ServerGroup) -> None:
    """Fill ``group.deposed`` from a snapshot group (format 1 has none)."""
    deposed = entry.get("deposed", [])
    if not isinstance(deposed, list):
        raise RegistryError(f"{where}.deposed", "must be a list")
    for j, raw_record in enumerate(deposed):
        at = f"{where}.deposed[{j}]"
        item = check_mapping(at, raw_record)
        address = check_address(item.get("address"), f"{at}.address")
        incarnation = check_optional_text(f"{at}.incarnation", item.get("incarnation"), INCARNATION_MAX)
        group.deposed[address] = DeposedMaster(incarnation, check_address(item.get("by"), f"{at}.by"))


def _restore_managed(where: str, entry: Mapping[str, Any], group: ServerGroup) -> None:
    """A snapshot group's format-3 fields (absent before: a group that is not managed)."""
    managed = entry.get("managed", False)
    if not isinstance(managed, bool):
        raise RegistryError(f"{where}.managed", f"must be true or false, got {shown(managed)}")
    epoch = check_count(f"{where}.epoch", entry.get("epoch", 0), maximum=INT_MAX)
    in_sync = entry.get("in_sync", [])
    if not isinstance(in_sync, list):
        raise RegistryError(f"{where}.in_sync", "must be a list")
    addresses = tuple(check_address(a, f"{where}.in_sync[{i}]") for i, a in enumerate(in_sync))
    handover_to = entry.get("handover_to")
    if handover_to is not None:
        check_address(handover_to, f"{where}.handover_to")
    if "master" in entry:
        master = entry["master"]
        if master is not None:
            check_address(master, f"{where}.master")
        if master != group.master():
            raise RegistryError(f"{where}.master", f"is {shown(master)}, its servers say {shown(group.master())}")
    group.managed, group.epoch, group.in_sync = managed, epoch, addresses
    group.handover_to = handover_to if handover_to in group.servers else None


__all__ = ["SNAPSHOT_FORMAT", "SNAPSHOT_FORMATS_READ", "RestoredSnapshot", "read_snapshot", "snapshot_of"]
