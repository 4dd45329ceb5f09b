"""open_blocking: a data folder opened for a block is released however the block ends."""

from __future__ import annotations

import threading
from functools import partial
from pathlib import Path

import pytest
import trio
import trio.testing

from delaymq.storage.errors import StorageError
from delaymq.storage.state import StateStore
from delaymq.storage.threads import RunBlocking, open_blocking, run_in_thread, run_inline


@pytest.mark.parametrize("run_blocking", [run_in_thread, run_inline], ids=["thread", "inline"])
async def test_a_cancelled_block_still_releases_its_folder(tmp_path: Path, run_blocking: RunBlocking) -> None:
    opener = partial(StateStore.open, tmp_path)
    with trio.CancelScope() as scope:
        async with open_blocking(opener, StateStore.close, run_blocking=run_blocking):
            with pytest.raises(StorageError):
                StateStore.open(tmp_path)  # held: the folder is locked while the block runs
            scope.cancel()
            await trio.sleep_forever()
    assert scope.cancelled_caught
    StateStore.open(tmp_path).close()  # closed on the way out, cancelled as it was


async def test_an_error_in_the_block_comes_out_after_the_close(tmp_path: Path) -> None:
    with pytest.raises(KeyError, match="from the block"):
        async with open_blocking(partial(StateStore.open, tmp_path), StateStore.close, run_blocking=run_inline):
            raise KeyError("from the block")
    StateStore.open(tmp_path).close()


async def test_a_call_in_a_thread_is_not_abandoned_when_its_caller_is_cancelled() -> None:
    started = threading.Event()
    release = threading.Event()
    finished: list[int] = []

    def slow() -> int:
        started.set()
        release.wait(10)
        finished.append(1)
        return 5

    results: list[int] = []
    with trio.fail_after(10):
        with trio.CancelScope() as scope:

            async def call() -> None:
                results.append(await run_in_thread(slow))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(call)
                await trio.to_thread.run_sync(started.wait)
                scope.cancel()  # the call is in its thread: the caller waits for it all the same
                release.set()
    assert finished == [1]
    assert results == [5]


async def test_a_call_in_a_thread_raises_its_error_in_the_caller() -> None:
    def fails() -> None:
        raise KeyError("from the thread")

    with pytest.raises(KeyError, match="from the thread"):
        await run_in_thread(fails)


async def test_calls_in_threads_are_bounded_by_the_thread_limiter() -> None:
    limiter = trio.to_thread.current_default_thread_limiter()
    limiter.total_tokens = 2
    running = 0
    most = 0
    changed = threading.Condition()
    go = threading.Event()

    def work() -> None:
        nonlocal running, most
        with changed:
            running += 1
            most = max(most, running)
            changed.notify_all()
        go.wait(10)
        with changed:
            running -= 1

    def two_running() -> None:
        with changed:
            changed.wait_for(lambda: running >= 2, timeout=10)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            for _ in range(5):
                nursery.start_soon(run_in_thread, work)
            await trio.testing.wait_all_tasks_blocked()  # two in their threads, three waiting for one
            assert limiter.borrowed_tokens == 2
            assert limiter.statistics().tasks_waiting == 3
            await trio.to_thread.run_sync(two_running, limiter=trio.CapacityLimiter(1))  # not the full one
            go.set()
    assert most == 2
    assert limiter.borrowed_tokens == 0
