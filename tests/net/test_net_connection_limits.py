"""Connection limits: idle and slow connections closed, caps refused with a clear, retryable error."""

from __future__ import annotations

import trio
import trio.testing

from delaymq.net.connection import Connection, PeerUnavailable
from delaymq.net.limits import ConnectionLimits, Limits
from delaymq.net.peers import open_peers
from delaymq.net.requests import Request
from delaymq.net.server import FrameServer
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import PeerError
from delaymq.protocol.frames import Frame, FrameDecoder, FrameKind, encode_frame, request


async def ping(req: Request) -> dict | tuple[dict, bytes]:
    if req.metadata.get("sleep"):
        await trio.sleep(req.metadata["sleep"])
    if req.metadata.get("answer_bytes"):
        return {}, b"x" * req.metadata["answer_bytes"]
    return {"echo": req.metadata.get("value")}


def make_server(*, max_frame: int = 64 * 1024 * 1024, **connections: object) -> FrameServer:
    limits = Limits(max_frame=max_frame, connections=ConnectionLimits(**connections))  # type: ignore[arg-type]
    return FrameServer({Command.PING: ping}, limits=limits)


async def read_until_closed(stream: trio.abc.ReceiveStream) -> tuple[list[Frame], float]:
    """Every frame until the server closes the stream, and the time it closed."""
    decoder = FrameDecoder()
    frames: list[Frame] = []
    while data := await stream.receive_some(65536):
        decoder.feed(data)
        frames.extend(decoder)
    return frames, trio.current_time()


def ping_frame(request_id: int, *, size: int) -> bytes:
    """A PING request frame of exactly ``size`` bytes."""
    data = encode_frame(request(Command.PING, request_id, {}, b"x" * (size - 18)))
    assert len(data) == size
    return data


class ClientOf:
    """A ``Connection`` on an in-memory stream to ``server``; ``ended`` is set when the server closes it."""

    def __init__(self, server: FrameServer, nursery: trio.Nursery) -> None:
        client_end, server_end = trio.testing.memory_stream_pair()
        self.connection = Connection("memory", client_end, limits=Limits())
        self.ended = trio.Event()
        self.ended_at = 0.0
        nursery.start_soon(server.serve_stream, server_end)
        nursery.start_soon(self._read)

    async def _read(self) -> None:
        await self.connection.read_responses()
        self.ended_at = trio.current_time()
        self.ended.set()


# ------------------------------------------------------------------ idle and slow


async def test_an_idle_connection_is_closed_after_the_idle_timeout(autojump_clock: trio.testing.MockClock) -> None:
    server = make_server(idle_timeout=300)
    async with trio.open_nursery() as nursery:
        client = ClientOf(server, nursery)
        await trio.sleep(100)  # quiet, but not yet idle for long
        assert (await client.connection.call(Command.PING, {"value": 1}, timeout=5)).metadata == {"echo": 1}
        answered_at = trio.current_time()
        with trio.fail_after(1000):
            await client.ended.wait()
    assert 300 <= client.ended_at - answered_at < 301
    stats = server.statistics()
    assert (stats.closed_idle, stats.closed_slow, stats.connections_open) == (1, 0, 0)


async def test_a_long_poll_in_flight_is_not_idle(autojump_clock: trio.testing.MockClock) -> None:
    server = make_server(idle_timeout=300)
    async with trio.open_nursery() as nursery:
        client = ClientOf(server, nursery)
        start = trio.current_time()
        frame = await client.connection.call(Command.PING, {"value": "late", "sleep": 1000}, timeout=2000)
        assert frame.metadata == {"echo": "late"}  # answered after 1000 s on the same connection
        assert trio.current_time() - start >= 1000
        with trio.fail_after(1000):
            await client.ended.wait()
    assert 1300 <= client.ended_at - start < 1301  # idle counts from the answer
    assert server.statistics().closed_idle == 1


async def test_a_half_sent_frame_is_answered_and_closed_after_the_frame_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    server = make_server(frame_timeout=60, idle_timeout=3600)
    client_end, server_end = trio.testing.memory_stream_pair()
    frame = ping_frame(7, size=10_000)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.serve_stream, server_end)
        start = trio.current_time()
        # A slowloris: a byte every 10 s keeps the connection busy, never the frame complete.
        for offset in range(5):
            await client_end.send_all(frame[offset * 100 : offset * 100 + 100])
            await trio.sleep(10)
        with trio.fail_after(100):
            frames, closed_at = await read_until_closed(client_end)
    assert 60 <= closed_at - start < 61
    (answer,) = frames
    assert (answer.kind, answer.request_id, answer.command) == (FrameKind.RESPONSE, 7, Command.PING)
    error = answer.metadata["error"]
    assert (error["code"], error["field"], error["limit"]) == ("unavailable", "frame_timeout", "60s")
    assert "500 bytes of 10000 received" in error["message"]
    stats = server.statistics()
    assert (stats.closed_slow, stats.closed_idle, stats.buffered_bytes, stats.connections_open) == (1, 0, 0, 0)


async def test_a_client_that_never_reads_its_answers_is_closed(autojump_clock: trio.testing.MockClock) -> None:
    server = make_server(frame_timeout=60)
    # Lockstep: a write waits until the other side reads, as a full socket buffer would.
    client_end, server_end = trio.testing.lockstep_stream_pair()
    served = trio.Event()

    async def serve() -> None:
        await server.serve_stream(server_end)
        served.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve)
        start = trio.current_time()
        await client_end.send_all(ping_frame(1, size=100))  # and never read the answer
        with trio.fail_after(100):
            await served.wait()
        assert 60 <= trio.current_time() - start < 61
    stats = server.statistics()
    assert (stats.closed_slow, stats.connections_open) == (1, 0)


# ------------------------------------------------------------------ caps


async def test_past_the_buffered_budget_the_growing_frame_is_refused_and_the_other_completes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    server = make_server(max_frame=1000)  # the budget: two whole frames, 2000 bytes
    first_end, first_server = trio.testing.memory_stream_pair()
    second_end, second_server = trio.testing.memory_stream_pair()
    third_end, third_server = trio.testing.memory_stream_pair()
    first, second, third = ping_frame(1, size=1000), ping_frame(2, size=1000), ping_frame(3, size=1000)
    async with trio.open_nursery() as nursery:
        for stream in (first_server, second_server, third_server):
            nursery.start_soon(server.serve_stream, stream)
        await first_end.send_all(first[:900])
        await second_end.send_all(second[:900])
        await trio.testing.wait_all_tasks_blocked()
        assert server.statistics().buffered_bytes == 1800
        await third_end.send_all(third[:300])  # 2100: this one goes
        with trio.fail_after(10):
            frames, _ = await read_until_closed(third_end)
        (refused,) = frames
        error = refused.metadata["error"]
        assert (refused.request_id, error["code"], error["field"], error["limit"]) == (
            3,
            "unavailable",
            "buffered_bytes",
            2000,
        )
        await trio.testing.wait_all_tasks_blocked()
        assert server.statistics().buffered_bytes == 1800  # the closed connection's 300 let go
        await first_end.send_all(first[900:])
        await second_end.send_all(second[900:])
        for stream, request_id in ((first_end, 1), (second_end, 2)):
            decoder = FrameDecoder()
            while not (answers := list(decoder)):
                decoder.feed(await stream.receive_some(65536))
            assert [(a.request_id, a.metadata) for a in answers] == [(request_id, {"echo": None})]
        nursery.cancel_scope.cancel()
    stats = server.statistics()
    assert (stats.refused_for_buffered_bytes, stats.buffered_bytes, stats.buffered_bytes_peak) == (1, 0, 1800)


async def test_past_the_connection_cap_a_client_is_told_why_and_may_retry() -> None:
    server = make_server(max_connections=2)
    async with trio.open_nursery() as nursery:
        held = [ClientOf(server, nursery) for _ in range(2)]
        for client in held:
            assert (await client.connection.call(Command.PING, {"value": 1}, timeout=5)).metadata == {"echo": 1}
        refused = ClientOf(server, nursery)
        with trio.fail_after(10):
            await refused.ended.wait()
        assert refused.connection.refusal is not None
        message = str(refused.connection.refusal)
        assert "memory refused the connection" in message and "2 connections, its limit" in message
        try:
            await refused.connection.call(Command.PING, timeout=5)
        except PeerUnavailable as error:  # retryable: a TransportError
            assert "refused the connection" in str(error)
        else:
            raise AssertionError("a refused connection answered")
        await held[0].connection._stream.aclose()  # one leaves: room for the next
        with trio.fail_after(10):
            await held[0].ended.wait()
            while server.statistics().connections_open != 1:
                await trio.testing.wait_all_tasks_blocked()
        again = ClientOf(server, nursery)
        assert (await again.connection.call(Command.PING, {"value": 2}, timeout=5)).metadata == {"echo": 2}
        nursery.cancel_scope.cancel()
    stats = server.statistics()
    assert (stats.refused_at_connection_cap, stats.connections_total) == (1, 3)


async def test_one_address_at_its_cap_does_not_lock_out_another() -> None:
    server = make_server(max_per_address=3)
    async with trio.open_nursery() as nursery:
        address = await nursery.start(server.serve)
        host, port = address.rsplit(":", 1)

        async def connect_from(source: str) -> Connection:
            sock = trio.socket.socket()
            await sock.bind((source, 0))
            await sock.connect((host, int(port)))
            connection = Connection(address, trio.SocketStream(sock), limits=Limits())
            nursery.start_soon(connection.read_responses)
            return connection

        flood = [await connect_from("127.0.0.2") for _ in range(3)]
        for connection in flood:  # each answered: each admitted
            assert (await connection.call(Command.PING, {"value": 0}, timeout=10)).metadata == {"echo": 0}
        fourth = await connect_from("127.0.0.2")
        try:
            await fourth.call(Command.PING, timeout=10)
        except PeerUnavailable as error:
            assert "3 connections from 127.0.0.2, the limit per client address" in str(error)
        else:
            raise AssertionError("the fourth connection from 127.0.0.2 was served")
        async with open_peers() as peers:  # from 127.0.0.1: served
            assert (await peers.call(address, Command.PING, {"value": 9})).metadata == {"echo": 9}
        stats = server.statistics()
        assert (stats.refused_at_address_cap, stats.connections_open) == (1, 3)
        nursery.cancel_scope.cancel()


async def test_an_answer_over_the_frame_limit_is_an_error_not_the_end_of_the_server() -> None:
    server = make_server(max_frame=1000)
    async with trio.open_nursery() as nursery:
        client = ClientOf(server, nursery)
        try:
            await client.connection.call(Command.PING, {"answer_bytes": 5000}, timeout=5)
        except PeerError as error:
            assert error.code == "internal" and "exceeds the frame limit of 1000" in str(error)
        else:
            raise AssertionError("an oversize answer was sent")
        assert (await client.connection.call(Command.PING, {"value": 1}, timeout=5)).metadata == {"echo": 1}
        nursery.cancel_scope.cancel()


async def test_a_refused_frame_gives_its_bytes_back_before_its_refusal_is_written(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Else every connection read while a refusal is written is refused too (all 8 in the fault test)."""
    server = make_server(max_frame=1000, max_buffered=1500)
    patient_end, patient_server = trio.testing.memory_stream_pair()
    # Lockstep: the refusal's write waits until this client reads it.
    greedy_end, greedy_server = trio.testing.lockstep_stream_pair()
    patient, greedy = ping_frame(1, size=1000), ping_frame(2, size=1000)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.serve_stream, patient_server)
        nursery.start_soon(server.serve_stream, greedy_server)
        await patient_end.send_all(patient[:700])
        await greedy_end.send_all(greedy[:700])
        await trio.testing.wait_all_tasks_blocked()
        assert server.statistics().buffered_bytes == 1400
        await greedy_end.send_all(greedy[700:900])  # 1600: refused; its answer waits to be read
        await trio.testing.wait_all_tasks_blocked()
        assert server.statistics().buffered_bytes == 700  # its 700 already given back
        await patient_end.send_all(patient[700:950])  # 950: within the budget
        await patient_end.send_all(patient[950:])
        decoder = FrameDecoder()
        while not (answers := list(decoder)):
            decoder.feed(await patient_end.receive_some(65536))
        assert [(a.request_id, a.metadata) for a in answers] == [(1, {"echo": None})]
        frames, _ = await read_until_closed(greedy_end)
        assert [(f.request_id, f.metadata["error"]["field"]) for f in frames] == [(2, "buffered_bytes")]
        nursery.cancel_scope.cancel()
    assert server.statistics().refused_for_buffered_bytes == 1
