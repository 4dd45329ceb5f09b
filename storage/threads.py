"""Where blocking work (fsync, lmdb, large reads) runs: a worker thread, or inline in tests.

Every server, and the log writer, takes a keyword ``run_blocking`` and runs its
blocking calls only through it: ``run_in_thread`` by default, so its event loop
never waits on the disk; tests under ``autojump_clock`` pass ``run_inline``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Protocol, TypeVar

import outcome
import trio

T = TypeVar("T")


class RunBlocking(Protocol):
    """How blocking calls are run: ``run_in_thread`` or ``run_inline``."""

    def __call__(self, function: Callable[[], T], /) -> Awaitable[T]: ...


async def run_in_thread(function: Callable[[], T]) -> T:
    """The default ``RunBlocking``: a worker thread, so the event loop never waits on the disk.

    Not abandoned on cancel: a started call finishes, and its caller learns its result
    (its exception included). Threads are bounded by trio's default thread limiter, as
    with ``trio.to_thread.run_sync``; this is that call without what a server never
    uses (thread names, context copies, ``trio.from_thread``), which costs about a
    sixth less CPU per call.
    """
    await trio.lowlevel.checkpoint_if_cancelled()
    task = trio.lowlevel.current_task()
    limiter = trio.to_thread.current_default_thread_limiter()
    try:
        limiter.acquire_on_behalf_of_nowait(task)
    except trio.WouldBlock:
        await limiter.acquire_on_behalf_of(task)
    token = trio.lowlevel.current_trio_token()

    def wake(result: outcome.Outcome[T]) -> None:
        limiter.release_on_behalf_of(task)
        trio.lowlevel.reschedule(task, result)

    def deliver(result: outcome.Outcome[T]) -> None:  # in the worker thread
        token.run_sync_soon(wake, result)

    try:
        trio.lowlevel.start_thread_soon(function, deliver)  # the thread captures the outcome
    except BaseException:
        limiter.release_on_behalf_of(task)
        raise
    result: T = await trio.lowlevel.wait_task_rescheduled(_refuse_abort)  # unwrapped: raises its error
    return result


def _refuse_abort(_raise_cancel: object) -> trio.lowlevel.Abort:
    return trio.lowlevel.Abort.FAILED  # a started call is never abandoned


async def run_inline(function: Callable[[], T]) -> T:
    """Run a blocking call on the event loop itself.

    For tests under ``autojump_clock``: the mock clock jumps ahead whenever every
    task waits, a task waiting on a worker thread included, so a thread would let
    time race past heartbeats while lmdb writes.
    """
    await trio.lowlevel.checkpoint()
    return function()


@asynccontextmanager
async def open_blocking(
    open_: Callable[[], T], close: Callable[[T], object], *, run_blocking: RunBlocking = run_in_thread
) -> AsyncIterator[T]:
    """What ``open_()`` returns, for the block; passed to ``close`` however the block ends.

    Both are blocking calls (a data folder's files and lmdb) run through
    ``run_blocking``. The close is shielded, so a cancelled server still releases
    its folder (and the folder's lock) before it returns.
    """
    opened = await run_blocking(open_)
    try:
        yield opened
    finally:
        with trio.CancelScope(shield=True):
            await run_blocking(partial(close, opened))


__all__ = ["RunBlocking", "open_blocking", "run_in_thread", "run_inline"]
