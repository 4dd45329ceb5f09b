"""The running part every server shares: background tasks, the listener, registration, the block.

Each server (scheduler, realtime server, metaserver) opens its data folder and
builds its parts itself, then runs them with ``serve_frames`` for the duration of
its own ``async with`` block. The start-up order is the same for all: the
background tasks, each ready before the next starts (``nursery.start``); then the
listener; then registration with the metaserver (a callable the server passes in,
since registering is client code); then the block. When the block ends all of it
is cancelled, and an exception from the block comes out as itself, not inside the
nursery's exception group. A failure while starting is raised as trio raises it
(inside that group).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager

import trio

from delaymq.protocol.transport import FrameServer

#: A background task for ``nursery.start``: takes ``task_status`` and reports when ready.
Task = Callable[..., Awaitable[object]]
#: Registers the server at an address, its heartbeats (if any) running in the nursery.
Register = Callable[[trio.Nursery, str], Awaitable[None]]


@asynccontextmanager
async def serve_frames(
    frame_server: FrameServer,
    *,
    bind: tuple[str, int] | None,
    advertise_address: str | None = None,
    tasks: Sequence[Task] = (),
    register: Register | None = None,
) -> AsyncIterator[str]:
    """Start ``tasks``, serve on ``bind`` (host, port), ``register``; yield the address.

    The address is the bound "host:port"; with ``bind=None`` (no listener:
    connections go to ``frame_server.serve_stream``) it is ``advertise_address`` or
    "". ``register`` gets ``advertise_address`` or that address.
    """
    body_error: Exception | None = None
    async with trio.open_nursery() as nursery:
        for task in tasks:
            await nursery.start(task)
        address: str
        if bind is not None:
            address = await nursery.start(frame_server.serve, *bind)
        else:
            address = advertise_address or ""
        if register is not None:
            await register(nursery, advertise_address or address)
        try:
            yield address
        except Exception as error:
            body_error = error  # raised below, not inside an ExceptionGroup
        finally:
            nursery.cancel_scope.cancel()
    if body_error is not None:
        raise body_error


__all__ = ["Register", "Task", "serve_frames"]
