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

import gc
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager

import trio

from delaymq.net.server import FrameServer

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


#: The cyclic collector's thresholds in a server process (CPython's default: 700, 10, 10).
#: A server allocates a few container objects per message it handles, most of them freed
#: at once or kept long (the unfiled tail, the dedup window); at 700 the scheduler spent
#: about 11 % of its CPU in collections while a producer sent flat out. ``delaymq bench
#: delay``'s runs (producer and consumer, delaymq's and Redis's alike) collect the same way:
#: at 700 a producer sending flat out, its batches' messages and ids alive until answered,
#: spent about 0.26 µs a message there (docs/performance.md, "The benchmark's collector").
SERVER_GC_THRESHOLDS = (10_000, 10, 10)


@contextmanager
def tuned_collector() -> Iterator[None]:
    """For the block, collect cycles less often and never scan what was there before it (modules,
    classes, a benchmark's earlier results: ``gc.freeze``); the collector as it was afterwards,
    however the block ends (a server run in-process, one benchmark run). Not nested: the inner
    block's end would unfreeze the outer one's heap."""
    thresholds = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(*SERVER_GC_THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()


__all__ = ["SERVER_GC_THRESHOLDS", "Register", "Task", "serve_frames", "tuned_collector"]
