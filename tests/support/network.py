"""Servers on a ``MemoryNetwork``: a metaserver to start a cluster with, and partitions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from delaymq.clock import Clock
from delaymq.metaserver.server import open_metaserver
from delaymq.net.connection import PeerUnavailable
from delaymq.net.testing import MemoryNetwork
from delaymq.protocol.frames import Frame
from delaymq.storage.threads import run_inline


class Partition:
    """A member's network with some addresses cut off (a partition, not a crash)."""

    def __init__(self, net: MemoryNetwork) -> None:
        self.net = net
        self.cut: set[str] = set()

    async def call(
        self, address: str, command: int, metadata: dict[str, Any] | None = None, body: bytes = b"", *,
        timeout: float | None = None,
    ) -> Frame:  # fmt: skip
        if address in self.cut:
            raise PeerUnavailable(f"{address} is cut off", address=address)
        return await self.net.call(address, command, metadata, body, timeout=timeout)


@asynccontextmanager
async def open_memory_metaserver(
    tmp: Path, clock: Clock, address: str, **options: Any
) -> AsyncIterator[tuple[MemoryNetwork, trio.Nursery]]:
    """A metaserver (``options``: ``open_metaserver``'s) on ``tmp/meta``, served at ``address`` on a new
    ``MemoryNetwork`` (30 s request timeout); yields the network and its nursery, cancelled at the end."""
    async with AsyncExitStack() as stack:
        meta = await stack.enter_async_context(
            open_metaserver(listen=None, data_dir=tmp / "meta", clock=clock, run_blocking=run_inline, **options)
        )
        nursery = await stack.enter_async_context(trio.open_nursery())
        net = MemoryNetwork(nursery, timeout=30)
        net.serve(address, meta.serve_stream)
        try:
            yield net, nursery
        finally:
            nursery.cancel_scope.cancel()
