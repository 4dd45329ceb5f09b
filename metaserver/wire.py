"""The wire form of the metaserver's requests and answers: metadata fields read and
checked, registry refusals turned into error answers, replies and status rows as maps."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from delaymq.metaserver.answers import HeartbeatReply, StatusRow
from delaymq.metaserver.errors import MemberTaken, RegistryError, Superseded
from delaymq.net.requests import Request
from delaymq.protocol.errors import RemoteProtocolError
from delaymq.protocol.routes import MEMBER_TAKEN, SUPERSEDED

# The wire names of the fields whose registry names differ.
_WIRE_FIELDS = {"software_version": "version"}


@contextmanager
def refusals(command: str) -> Iterator[None]:
    """Turn a ``RegistryError`` into the ``bad_request`` answer naming its field."""
    try:
        yield
    except Superseded as error:
        raise RemoteProtocolError(f"{command}: {error.args[0]}", code=SUPERSEDED, field=error.field) from None
    except MemberTaken as error:
        message = str(error).split(": ", 1)[-1]
        raise RemoteProtocolError(f"{command}: {message}", code=MEMBER_TAKEN, field=error.field) from None
    except RegistryError as error:
        field = _WIRE_FIELDS.get(error.field, error.field)
        message = str(error).split(": ", 1)[-1]
        raise RemoteProtocolError(f"{command}: {field}: {message}", code="bad_request", field=field) from None


def metadata_field(command: str, metadata: Mapping[str, Any], name: str, kind: type, *, required: bool = True) -> Any:
    """One metadata field, present and of the right type (None if optional and absent)."""
    value = metadata.get(name)
    if value is None:
        if required:
            raise RemoteProtocolError(f"{command}: field {name!r} is missing", code="bad_request", field=name)
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise RemoteProtocolError(
            f"{command}: field {name!r} must be {kind.__name__}, got {type(value).__name__}",
            code="bad_request",
            field=name,
        )
    return value


def asked_by(request: Request) -> str:
    """Who sent an admin request, for the log: its token's name (with a tokens file) and address."""
    if request.identity is None:
        return request.peer
    return f"{request.identity.name!r} from {request.peer}"


def heartbeat_answer(reply: HeartbeatReply) -> dict[str, Any]:
    """The answer to REGISTER and HEARTBEAT; a managed group's servers also learn role and epoch."""
    answer: dict[str, Any] = {
        "state": reply.state.value,
        "master": reply.master,
        "route_version": reply.route_version,
        "heartbeat_interval_ms": reply.heartbeat_interval_ms,
    }
    if reply.role is not None:  # a managed group
        answer["role"] = reply.role.value
        answer["epoch"] = reply.epoch
        if reply.handover_to is not None:
            answer["handover_to"] = reply.handover_to
        if reply.in_sync is not None:
            answer["in_sync"] = list(reply.in_sync)
    return answer


def status_answer_row(row: StatusRow) -> dict[str, Any]:
    """One server in the STATUS answer (the wire calls its software version ``version``)."""
    return {
        "group": row.group,
        "kind": row.kind.value,
        "role": row.role.value,
        "address": row.address,
        "state": row.state.value,
        "version": row.software_version,
        "seconds_since_heartbeat": row.seconds_since_heartbeat,
        "evicted": row.evicted,
        "is_master": row.is_master,
        "epoch": row.epoch,
        "member": row.member,
        "offset": row.offset,
        "in_sync": row.in_sync,
    }


__all__ = ["asked_by", "heartbeat_answer", "metadata_field", "refusals", "status_answer_row"]
