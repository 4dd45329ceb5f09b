"""Metaservers for the tests: in this process, store calls inline, on a ``TrioClock`` (autojump)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from delaymq.client.registration import Registration, run_registration
from delaymq.clock import TrioClock
from delaymq.metaserver.server import Metaserver, open_metaserver
from delaymq.net.testing import MemoryNetwork
from delaymq.storage.threads import run_inline

T0 = 1_700_000_000_000
META = "meta:20880"


@dataclass
class Metaservers:
    """Metaservers on folders of ``data``, all on one ``clock`` (open one again to restart it)."""

    data: Path
    clock: TrioClock

    def open(self, folder: str = "", **options: Any) -> AbstractAsyncContextManager[Metaserver]:
        return open_metaserver(
            listen=None, data_dir=self.data / folder, clock=self.clock, run_blocking=run_inline, **options
        )

    @asynccontextmanager
    async def serving(self, network: MemoryNetwork, folder: str = "", **options: Any) -> AsyncIterator[Metaserver]:
        """A metaserver reachable at ``META`` on ``network``, which outlives it."""
        async with self.open(folder, **options) as meta:
            network.serve(META, meta.serve_stream)
            yield meta

    @asynccontextmanager
    async def network(self) -> AsyncIterator[tuple[MemoryNetwork, trio.Nursery]]:
        """An in-memory network that metaservers come and go on, and its nursery (cancelled at the end)."""
        async with trio.open_nursery() as nursery:
            yield MemoryNetwork(nursery), nursery
            nursery.cancel_scope.cancel()

    @asynccontextmanager
    async def on_network(self, **options: Any) -> AsyncIterator[tuple[Metaserver, MemoryNetwork, trio.Nursery]]:
        """A metaserver reachable at ``META`` on an in-memory network, and the network's nursery."""
        async with self.open(**options) as meta, self.network() as (network, nursery):
            network.serve(META, meta.serve_stream)
            yield meta, network, nursery

    async def start_agent(self, nursery: trio.Nursery, network: MemoryNetwork, info: dict[str, Any]) -> Registration:
        """A server's registration agent, run in ``nursery``; returns after its first attempt."""
        registration: Registration = await nursery.start(
            partial(run_registration, network, meta_address=META, info=info, clock=self.clock)
        )
        return registration

    async def register_then_die(self, network: MemoryNetwork, info: dict[str, Any]) -> None:
        """A server that registers, then dies at once (as SIGKILLed: it never heartbeats)."""
        async with trio.open_nursery() as server:
            await self.start_agent(server, network, info)
            server.cancel_scope.cancel()


@pytest.fixture
async def metaservers(tmp_path: Path) -> Metaservers:
    """Tests name ``autojump_clock`` too: pytest-trio runs with a clock among the test's arguments."""
    return Metaservers(tmp_path, TrioClock(T0))
