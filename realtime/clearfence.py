"""CLEAR_FENCE on a realtime server: an admin makes it forget a scheduler group's fence.

Request ``{"group": scheduler group}`` (admin role: the transport refuses other tokens);
answer ``{"group": g, "cleared": the epoch it had, or None}``. Served by the master only
(a slave answers ``not_master``, as it does PULL): the master forgets the epoch in lmdb,
then ships the clear to its slaves as a progress record (``fences.Fences.clear``), so the
group's slaves forget it too, in log order with the raises around it. The next fenced
SEND of the group sets its epoch again. For a fence a SEND set wrongly (a mistaken or
forged epoch that fences the group's real master out): ``delaymq admin clear-fence``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

from delaymq.net.requests import Request
from delaymq.protocol.errors import RemoteProtocolError
from delaymq.protocol.fencing import group_name_problem
from delaymq.realtime.query import Serving

if TYPE_CHECKING:
    from delaymq.realtime.master import RealtimeMaster

log = logging.getLogger(__name__)

_FIELDS = ("group",)


def parse_clear_fence(metadata: Mapping[str, Any]) -> str:
    """The scheduler group a CLEAR_FENCE names; ``bad_request`` naming the field otherwise."""
    for key in metadata:
        if key not in _FIELDS:
            raise RemoteProtocolError(
                f"CLEAR_FENCE: unknown field {key!r} (it takes: group)", code="bad_request", field=str(key)
            )
    group = metadata.get("group")
    problem = group_name_problem(group)
    if problem is not None:
        raise RemoteProtocolError(
            f"CLEAR_FENCE: group (the scheduler group) {'is missing' if group is None else problem}",
            code="bad_request",
            field="group",
        )
    assert isinstance(group, str)
    return group


async def serve_clear_fence(server: Serving, request: Request) -> dict[str, Any]:
    """CLEAR_FENCE, served by the master (replicated: too few slaves in sync refuse it first)."""
    group = parse_clear_fence(request.metadata)
    answer: dict[str, Any] = await server._serve(
        "CLEAR_FENCE", lambda master: partial(_clear, master, server.group, group), request
    )
    return answer


async def _clear(master: RealtimeMaster, own_group: str, group: str, request: Request) -> dict[str, Any]:
    before = await master.fences.clear(group)
    who = f"token {request.identity.name!r}" if request.identity is not None else "a request without a token"
    log.warning(
        "realtime %s: fence of scheduler group %s cleared by %s (it was at epoch %s); the group's next "
        "fenced SEND sets it again",
        own_group,
        group,
        who,
        "none" if before is None else before,
    )
    return {"group": group, "cleared": before}


__all__ = ["parse_clear_fence", "serve_clear_fence"]
