"""A tiny frame-speaking client for the realtime tests (the real Consumer is built elsewhere), and
realtime servers run in the test process on the trio clock."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing

from delaymq.clock import TrioClock
from delaymq.net.connection import Connection
from delaymq.net.limits import Limits
from delaymq.protocol.commands import Command
from delaymq.protocol.frames import Frame
from delaymq.protocol.records import Message, decode_batch, encode_batch
from delaymq.realtime import RealtimeServer, open_realtime_server
from delaymq.storage.threads import run_inline

from ..support.polling import wait_until

Call = Callable[[int, dict[str, Any], bytes], Awaitable[Frame]]
EPOCH = 1_700_000_000_000


@dataclass
class Pulled:
    start: int
    count: int
    acked: int
    messages: list[Message]

    @property
    def end(self) -> int:
        return self.start + self.count

    @property
    def ids(self) -> list[str]:
        return [message.id for message in self.messages]


class Client:
    """SEND / PULL / ACK / NACK / CONSUMER_HEARTBEAT as plain calls."""

    def __init__(self, call: Call, *, group: str = "g", consumer: str = "c", subject: str = "orders") -> None:
        self._call = call
        self.group = group
        self.consumer = consumer
        self.subject = subject

    async def send(self, messages: list[Message]) -> list[str]:
        frame = await self._call(Command.SEND, {}, encode_batch(messages))
        return frame.metadata["results"]

    async def send_raw(self, metadata: dict[str, Any], body: bytes) -> Frame:
        return await self._call(Command.SEND, metadata, body)

    async def status(self) -> dict[str, Any]:
        return (await self._call(Command.STATUS, {}, b"")).metadata

    async def pull(self, max: int = 100, *, timeout_ms: int = 0, **options: Any) -> Pulled:
        metadata = {
            "group": self.group,
            "consumer": self.consumer,
            "subject": self.subject,
            "max": max,
            "timeout_ms": timeout_ms,
            **options,
        }
        frame = await self._call(Command.PULL, metadata, b"")
        meta = frame.metadata
        messages = decode_batch(frame.body) if frame.body else []
        assert len(messages) == meta["count"]
        return Pulled(meta["pull_start"], meta["count"], meta["acked"], messages)

    async def ack(self, start: int, end: int, **extra: Any) -> int:
        metadata = {"group": self.group, "consumer": self.consumer, "subject": self.subject, "start": start, "end": end}
        frame = await self._call(Command.ACK, {**metadata, **extra}, b"")
        return frame.metadata["acked"]

    async def nack(self, start: int, end: int | None, **extra: Any) -> int:
        """NACK ``[start, end)`` (``end`` None: left out, as a release to the end of the pull log sends it)."""
        metadata = {"group": self.group, "consumer": self.consumer, "subject": self.subject, "start": start}
        if end is not None:
            metadata["end"] = end
        frame = await self._call(Command.NACK, {**metadata, **extra}, b"")
        return frame.metadata["acked"]

    async def heartbeat(self) -> None:
        await self._call(
            Command.CONSUMER_HEARTBEAT,
            {"group": self.group, "consumer": self.consumer, "subjects": [self.subject]},
            b"",
        )


def messages(count: int, *, prefix: str = "m", subject: str = "orders", tags: tuple[str, ...] = ()) -> list[Message]:
    return [Message(f"{prefix}{i:05d}", subject, tags=tags, body=f"body {prefix}{i}".encode()) for i in range(count)]


def peers_client(peers: Any, address: str, **names: Any) -> Client:
    async def call(command: int, metadata: dict[str, Any], body: bytes) -> Frame:
        return await peers.call(address, command, metadata, body, timeout=60)

    return Client(call, **names)


@asynccontextmanager
async def memory_client(server: Any, **names: Any) -> AsyncIterator[Client]:
    """A client on an in-memory connection to ``server`` (safe with autojump_clock)."""
    client_end, server_end = trio.testing.memory_stream_pair()
    connection = Connection("memory", client_end, limits=Limits())

    async def call(command: int, metadata: dict[str, Any], body: bytes) -> Frame:
        return await connection.call(command, metadata, body, timeout=3600)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.serve_stream, server_end)
        nursery.start_soon(connection.read_responses)
        yield Client(call, **names)
        nursery.cancel_scope.cancel()


@pytest.fixture
def rt() -> SimpleNamespace:
    return SimpleNamespace(
        Client=Client,
        messages=messages,
        peers_client=peers_client,
        memory_client=memory_client,
        # A condition of the server, checked at every scheduling round, within 10 s unless ``timeout=``.
        wait_until=partial(wait_until, timeout=10, interval=0.001),
    )


@dataclass
class LocalServers:
    """Realtime servers on one data folder, in the test process: a ``TrioClock`` at ``EPOCH``, disk work inline."""

    data: Path
    clock: TrioClock

    def server(self, **options: Any) -> AbstractAsyncContextManager[RealtimeServer]:
        """A server on ``data`` (open it again to restart it); ``options`` go to ``open_realtime_server``."""
        options.setdefault("run_blocking", run_inline)
        return open_realtime_server(data_dir=self.data, clock=self.clock, **options)


@pytest.fixture
async def local(tmp_path: Path) -> LocalServers:
    """Tests name ``autojump_clock`` too: pytest-trio runs with a clock among the test's arguments."""
    return LocalServers(tmp_path, TrioClock(EPOCH))
