"""Bounded polls for a condition the servers reach by themselves, where there is no event to wait on."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import TypeVar

import trio

T = TypeVar("T")


async def wait_until(condition: Callable[[], object], *, timeout: float | None = 120, interval: float = 0.01) -> None:
    """Poll ``condition()`` every ``interval`` seconds until it holds.

    Both are seconds of trio's clock (virtual ones where the clock autojumps); after ``timeout`` the
    test fails (``TooSlowError``). ``timeout=None`` leaves the bound to the caller's own ``fail_after``.
    """
    with trio.fail_after(timeout) if timeout is not None else nullcontext():
        while not condition():
            await trio.sleep(interval)


def poll_until(
    read: Callable[[], T],
    ready: Callable[[T], object] = bool,
    *,
    timeout: float,
    interval: float,
    what: str = "a condition",
) -> T:
    """``read()`` every ``interval`` wall-clock seconds until ``ready`` holds of what it returned, and return
    that (servers in other processes: no event to wait on). After ``timeout`` seconds the test fails
    (``AssertionError``, naming ``what`` and the last value read)."""
    deadline = time.monotonic() + timeout
    while True:
        value = read()
        if ready(value):
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out waiting for {what}: {value!r}")
        time.sleep(interval)
