"""A server's own connections (registration, delivery, replication FETCH) redial at once.

Each of those loops paces its retries itself; the transport's redial wait (0.1 s
growing to 5 s) stacked under it made a server reach a restarted metaserver or
realtime server seconds after it was back. Like the clients', the servers'
connections redial the moment their loop asks.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from delaymq.clock import SystemClock
from delaymq.metaserver.server import open_metaserver
from delaymq.net.addresses import format_address
from delaymq.net.connection import PeerUnavailable
from delaymq.net.peers import Peers
from delaymq.protocol.commands import Command
from delaymq.realtime.server import open_realtime_server
from delaymq.scheduler.server import open_scheduler


@pytest.fixture
def refused_address() -> Iterator[str]:
    """A loopback port bound but not listening: every connect to it is refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield format_address(*sock.getsockname()[:2])


async def assert_redials_at_once(peers: Peers, address: str) -> None:
    before = peers.statistics().connect_failures
    for _ in range(3):
        with pytest.raises(PeerUnavailable, match="cannot connect"):  # not "next attempt in ...": it dialled
            await peers.call(address, Command.PING, {}, timeout=5)
    assert peers.statistics().connect_failures == before + 3


async def test_a_realtime_servers_connections_redial_a_refusing_peer_at_once(
    tmp_path: Path, refused_address: str
) -> None:
    async with (
        open_metaserver(data_dir=tmp_path / "meta", clock=SystemClock()) as meta,
        open_realtime_server(data_dir=tmp_path / "rt", clock=SystemClock(), meta_address=meta.address) as server,
    ):
        peers = server.member.peers
        assert isinstance(peers, Peers)
        await assert_redials_at_once(peers, refused_address)


async def test_a_schedulers_connections_redial_a_refusing_peer_at_once(tmp_path: Path, refused_address: str) -> None:
    async with (
        open_metaserver(data_dir=tmp_path / "meta", clock=SystemClock()) as meta,
        open_scheduler(data_dir=tmp_path / "s", clock=SystemClock(), meta_address=meta.address) as scheduler,
    ):
        peers = scheduler.member.peers
        assert isinstance(peers, Peers)
        await assert_redials_at_once(peers, refused_address)


async def test_other_users_of_the_transport_keep_its_redial_wait(refused_address: str) -> None:
    async with trio.open_nursery() as nursery:
        peers = Peers(nursery)
        with pytest.raises(PeerUnavailable, match="cannot connect"):
            await peers.call(refused_address, Command.PING, {}, timeout=5)
        with pytest.raises(PeerUnavailable, match="next attempt in"):
            await peers.call(refused_address, Command.PING, {}, timeout=5)
        await peers.aclose()
        nursery.cancel_scope.cancel()
