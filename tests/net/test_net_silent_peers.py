"""A peer that goes silent (a link cut with no reset) is noticed within a PING's round and its
connection replaced; a slow but answering peer, and an idle connection, are left alone."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing

from delaymq.net.connection import (
    WRITE_PIECE,
    Connection,
    PeerSilent,
    PeerUnavailable,
    ProbeSettings,
    ProbeStep,
    RequestTimeout,
    SilenceProbe,
    TransportError,
)
from delaymq.net.limits import Limits
from delaymq.net.peers import Peers, open_peers
from delaymq.net.requests import Request
from delaymq.net.server import FrameServer
from delaymq.net.testing import MemoryNetwork
from delaymq.protocol.commands import Command

ADDRESS = "10.0.0.2:7000"


class CountingServer:
    """PING answered at once and counted; SEND answered after ``sleep`` seconds (a replication wait)."""

    def __init__(self) -> None:
        self.received: Counter[int] = Counter()
        self.frames = FrameServer({Command.PING: self.ping, Command.SEND: self.send})

    async def ping(self, request: Request) -> dict[str, Any]:
        self.received[Command.PING] += 1
        return {}

    async def send(self, request: Request) -> dict[str, Any]:
        self.received[Command.SEND] += 1
        await trio.sleep(request.metadata.get("sleep", 0))
        return {"results": ["ok"]}


@asynccontextmanager
async def silenceable_peers(monkeypatch: pytest.MonkeyPatch, **options: Any) -> AsyncIterator[tuple[Peers, MemoryNetwork, CountingServer]]:  # fmt: skip
    """``Peers`` dialling a ``CountingServer`` at ``ADDRESS`` over a network whose links can be cut."""
    server = CountingServer()
    async with trio.open_nursery() as nursery:
        network = MemoryNetwork(nursery)
        network.serve(ADDRESS, server.frames.serve_stream)
        monkeypatch.setattr(trio, "open_tcp_stream", network.open_tcp_stream)
        async with open_peers(**options) as peers:
            yield peers, network, server
        nursery.cancel_scope.cancel()


async def test_a_request_to_a_silent_peer_fails_within_the_probe_and_the_next_call_dials_afresh(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with silenceable_peers(monkeypatch, request_timeout=10.0, probe_after=1.0, probe_timeout=1.0) as (
        peers,
        network,
        _server,
    ):
        await peers.call(ADDRESS, Command.SEND)
        await trio.sleep(60)  # idle first: silence while nothing is outstanding does not count
        network.silence(ADDRESS)
        failures: dict[str, tuple[BaseException, float]] = {}

        async def send(name: str) -> None:
            with pytest.raises(PeerSilent) as raised:
                await peers.call(ADDRESS, Command.SEND)
            failures[name] = (raised.value, trio.current_time())

        started = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send, "in flight at the cut")
            await trio.sleep(1.5)
            nursery.start_soon(send, "sent during the cut")  # on the same connection: it fails with it
        for error, at in failures.values():
            assert at - started == pytest.approx(2.0)  # probe_after + probe_timeout, not the request's 10 s
            assert isinstance(error, PeerUnavailable) and isinstance(error, TransportError)  # retryable
            assert "not even an answer to a PING" in str(error)
        await trio.testing.wait_all_tasks_blocked()  # its reader has ended
        assert peers.statistics().connections == 0  # dropped: the next call dials

        network.heal(ADDRESS)
        await peers.call(ADDRESS, Command.SEND)
        assert peers.statistics().connects == 2


async def test_a_slow_answer_is_not_cut_while_the_peer_answers_pings(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with silenceable_peers(monkeypatch, request_timeout=10.0) as (peers, _network, server):
        await peers.call(ADDRESS, Command.SEND)
        await trio.sleep(60)
        started = trio.current_time()
        frame = await peers.call(ADDRESS, Command.SEND, {"sleep": 5.0})  # a SEND waiting for its slaves
        assert frame.metadata == {"results": ["ok"]}
        assert trio.current_time() - started == pytest.approx(5.0)
        assert server.received[Command.PING] >= 2  # probed, and answered each time
        # One slower than its own timeout fails by that timeout, not as silent.
        with pytest.raises(RequestTimeout):
            await peers.call(ADDRESS, Command.SEND, {"sleep": 30.0}, timeout=8.0)
        assert peers.statistics().connects == 1


async def test_an_idle_connection_is_not_probed(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with silenceable_peers(monkeypatch) as (peers, _network, server):
        for _ in range(3):
            await peers.call(ADDRESS, Command.SEND, {"sleep": 0.5})  # answered before a probe is due
            await trio.sleep(60)  # idle: nothing outstanding, nothing sent
        assert server.received == Counter({Command.SEND: 3})
        assert peers.statistics().connects == 1


async def test_a_large_request_on_a_slow_link_is_not_taken_for_silence(autojump_clock: trio.testing.MockClock) -> None:
    server = CountingServer()
    client_end, server_end = trio.testing.memory_stream_pair()

    async def trickle() -> None:  # a slow link: a piece every 0.5 s, the whole frame in about 8 s
        while trio.testing.memory_stream_pump(client_end.send_stream, server_end.receive_stream, max_bytes=WRITE_PIECE):
            await trio.sleep(0.5)

    client_end.send_stream.send_all_hook = trickle
    connection = Connection("memory", client_end, limits=Limits(), probe=ProbeSettings(1.0, 1.0))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.frames.serve_stream, server_end)
        nursery.start_soon(connection.read_responses)
        started = trio.current_time()
        frame = await connection.call(Command.SEND, {}, b"x" * (16 * WRITE_PIECE), timeout=30)
        assert frame.metadata == {"results": ["ok"]}
        assert trio.current_time() - started > 2.0  # longer than a probe's round, and not given up
        nursery.cancel_scope.cancel()


async def test_a_dial_begun_during_a_cut_gets_through_within_a_second_of_the_heal(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def dial_through_a_cut(redial_every: float | None) -> float:
        """Seconds from the heal (4.5 s into a dial) to the answer."""
        async with silenceable_peers(monkeypatch, connect_timeout=10.0, redial_every=redial_every) as (
            peers,
            network,
            _server,
        ):
            network.silence(ADDRESS)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(peers.call, ADDRESS, Command.SEND)
                await trio.sleep(4.5)
                network.heal(ADDRESS)
                healed = trio.current_time()
            return trio.current_time() - healed

    # One attempt's SYNs go at 0, 1, 3, 7 s: it gets through 2.5 s after the heal...
    assert await dial_through_a_cut(None) == pytest.approx(2.5)
    # ...while a fresh attempt each second sends one within a second of it.
    assert await dial_through_a_cut(1.0) <= 1.0


@pytest.mark.parametrize("cut", [3.5, 6.5])
async def test_a_caller_retrying_through_a_cut_is_served_within_a_second_of_the_heal(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch, cut: float
) -> None:
    # Left to TCP, the SEND lost in the cut would arrive at its next retransmission, 2.7 s (or
    # 6.1 s) after the heal; a redial begun at 2.1 s would wait for its SYN at 5.1 s, 1.6 s after.
    async with silenceable_peers(monkeypatch, request_timeout=10.0) as (peers, network, _server):
        await peers.call(ADDRESS, Command.SEND)
        network.silence(ADDRESS)
        answered = trio.Event()

        async def deliver() -> None:  # as a scheduler's lane does: retry with a short backoff
            while True:
                try:
                    await peers.call(ADDRESS, Command.SEND)
                except TransportError:
                    await trio.sleep(0.1)
                else:
                    answered.set()
                    return

        async with trio.open_nursery() as nursery:
            nursery.start_soon(deliver)
            await trio.sleep(cut)
            network.heal(ADDRESS)
            healed = trio.current_time()
            await answered.wait()
            assert trio.current_time() - healed <= 1.0


def test_the_probe_pings_after_silence_and_gives_up_after_its_timeout() -> None:
    probe = SilenceProbe(ProbeSettings(after=1.0, timeout=1.0), now=0.0)
    cap = 1024
    assert probe.step(5.0, 0, cap) == (ProbeStep.IDLE, float("inf"))  # nothing outstanding: never a PING
    probe.busy(10.0)  # silence while idle does not count
    assert probe.step(10.0, 1, cap) == (ProbeStep.WAIT, 11.0)
    assert probe.step(11.0, 1, cap) == (ProbeStep.PING, 12.0)
    probe.heard(11.5)  # the PING's answer (or any bytes)
    assert probe.step(12.0, 1, cap) == (ProbeStep.WAIT, 12.5)
    assert probe.step(12.5, 1, cap) == (ProbeStep.PING, 13.5)
    assert probe.step(13.5, 1, cap) == (ProbeStep.DEAD, 13.5)


def test_the_probe_does_not_judge_a_connection_at_the_servers_in_flight_cap() -> None:
    probe = SilenceProbe(ProbeSettings(after=1.0, timeout=1.0), now=0.0)
    assert probe.step(1.0, 1, 4) == (ProbeStep.PING, 2.0)
    # The server reads no more at its cap: its silence says nothing, and the PING waits in its socket.
    assert probe.step(2.0, 4, 4) == (ProbeStep.WAIT, 3.0)
    assert probe.step(3.0, 3, 4) == (ProbeStep.PING, 4.0)  # below it again: silence counts from the cap
    with pytest.raises(ValueError, match="probe after must be a number of seconds above 0"):
        ProbeSettings(after=0)
