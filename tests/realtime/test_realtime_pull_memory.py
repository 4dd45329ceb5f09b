"""PULL of records just stored reads no file: their consume-log entries and bytes are in memory.

Older records (a consumer that lags, or after a restart) are read in worker threads
(``run_blocking``), never on the event loop, and arrive all the same.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from types import SimpleNamespace
from typing import Any, TypeVar

import trio
import trio.testing

from delaymq.realtime.consumelog import TAIL_ENTRIES
from delaymq.storage.threads import run_inline

T = TypeVar("T")


class CountedBlocking:
    """``run_inline`` that records the name of each blocking call."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def __call__(self, function: Callable[[], T]) -> T:
        target = function.func if isinstance(function, partial) else function
        self.calls.append(getattr(target, "__qualname__", repr(target)))
        return await run_inline(function)

    def reads(self) -> list[str]:
        return [name for name in self.calls if name in ("read_intact", "ConsumeLog.read")]


async def test_a_pull_of_records_just_stored_reads_no_file(
    local: Any, rt: SimpleNamespace, autojump_clock: trio.testing.MockClock
) -> None:
    blocking = CountedBlocking()
    sent = rt.messages(50)
    async with local.server(listen=None, run_blocking=blocking) as server, rt.memory_client(server) as client:
        await client.pull(1)  # the consumer joins (its share starts at the end)
        assert await client.send(sent[:30]) == ["stored"] * 30
        assert await client.send(sent[30:]) == ["stored"] * 20
        pulled = await client.pull(100)
        assert pulled.messages == sent
        assert blocking.reads() == []


async def test_records_not_in_memory_are_read_in_worker_threads_and_all_arrive(
    local: Any, rt: SimpleNamespace, autojump_clock: trio.testing.MockClock
) -> None:
    count = TAIL_ENTRIES * 3 + 7  # more than a consume log keeps in memory, many windows' worth
    sent = rt.messages(count)
    async with local.server(listen=None) as server, rt.memory_client(server) as client:
        for first in range(0, count, 1000):
            assert set(await client.send(sent[first : first + 1000])) == {"stored"}
    blocking = CountedBlocking()
    async with local.server(listen=None, run_blocking=blocking) as server:  # a restart: memory holds nothing
        async with rt.memory_client(server, group="reader") as reader:
            received = []
            while len(received) < count:
                pulled = await reader.pull(1000, **{"from": "earliest"})
                assert pulled.count
                received += pulled.messages
                await reader.ack(pulled.start, pulled.end)
        assert received == sent
        assert "ConsumeLog.read" in blocking.reads() and "read_intact" in blocking.reads()
