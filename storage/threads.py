"""Where blocking work (fsync, lmdb, large reads) runs: a worker thread, or inline in tests.

A server that takes a ``run_blocking`` gets ``run_in_thread`` by default, so its
event loop never waits on the disk; tests under ``autojump_clock`` pass
``run_inline``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio

T = TypeVar("T")
#: How blocking calls are run: ``run_in_thread`` or ``run_inline``.
RunBlocking = Callable[[Callable[[], T]], Awaitable[T]]


async def run_in_thread(function: Callable[[], T]) -> T:
    """The default ``RunBlocking``: a worker thread, so the event loop never waits on the disk."""
    return await trio.to_thread.run_sync(function)


async def run_inline(function: Callable[[], T]) -> T:
    """Run a blocking call on the event loop itself.

    For tests under ``autojump_clock``: the mock clock jumps ahead whenever every
    task waits, a task waiting on a worker thread included, so a thread would let
    time race past heartbeats while lmdb writes.
    """
    await trio.lowlevel.checkpoint()
    return function()


__all__ = ["RunBlocking", "run_in_thread", "run_inline"]
