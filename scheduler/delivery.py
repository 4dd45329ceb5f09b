"""How a master hands fired messages to realtime: SEND, fenced with its group and epoch.

The metaserver routes each subject to a realtime group (route ``DELIVERY_ROUTE``). A
realtime server that has seen a newer epoch of the group refuses the SEND ``fenced``:
the master was replaced, and stops (``fenced`` callback) before it sends more.
"""

from __future__ import annotations

from collections.abc import Callable

from delaymq.client.routes import NoRouteError, RouteClient
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import PeerError, RemoteProtocolError
from delaymq.protocol.fencing import FENCED, Fence
from delaymq.replication.roles import Mastership
from delaymq.scheduler.dispatcher import Deliver

DELIVERY_ROUTE = "scheduler-delivery"


def realtime_delivery(
    routes: RouteClient | None,
    group: str,
    epoch: int,
    mastership: Mastership,
    send_timeout: float,
    fenced: Callable[[int, int], None],
) -> Deliver:
    """SEND a subject's batch, fenced with this master's group and epoch, to a realtime group
    the metaserver routes it to; a fencing refusal stops this master (``fenced``)."""
    metadata = Fence(group, epoch).as_metadata() if epoch else {}

    async def deliver(subject: str, body: bytes) -> list[str]:
        if routes is None:
            raise NoRouteError("no metaserver address (meta_address) was given: no realtime group is known")
        await mastership.confirm()
        try:
            frame = await routes.call(
                DELIVERY_ROUTE, Command.SEND, metadata, body, subject=subject, timeout=send_timeout
            )
        except PeerError as error:
            if error.code == FENCED:
                highest = error.limit if isinstance(error.limit, int) else epoch + 1
                fenced(epoch, highest)
            raise
        results = frame.metadata.get("results")
        if not isinstance(results, list):
            raise RemoteProtocolError("SEND answer holds no 'results' list", code="bad_metadata", field="results")
        return results

    return deliver


async def no_delivery(subject: str, body: bytes) -> list[str]:
    """What a member that is not master delivers with: nothing."""
    raise RuntimeError("this member is not master: it delivers nothing")


__all__ = ["DELIVERY_ROUTE", "no_delivery", "realtime_delivery"]
