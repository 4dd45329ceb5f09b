"""Servers run in a task of their own, so that one can stop (``crash()``) while the others go on."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import TypeVar

import trio

T = TypeVar("T")


async def start_in_nursery(nursery: trio.Nursery, opened: AbstractAsyncContextManager[T]) -> T:
    """Enter ``opened`` (a server's ``open_…``) in a task of ``nursery`` and return what it yields; the
    task holds it open until the nursery is cancelled, or until the server's ``crash()`` ends only it."""

    async def run(*, task_status: trio.TaskStatus[T]) -> None:
        async with opened as value:
            task_status.started(value)
            await trio.sleep_forever()

    started: T = await nursery.start(run)
    return started
